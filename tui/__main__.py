import sys

from charllm.tui.cli import main

sys.exit(main())
