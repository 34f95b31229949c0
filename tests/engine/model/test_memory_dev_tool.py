"""tools/build_memory_dev.py: the shipped dev set (tests/data/memory_dev/memory_dev.json) is what it
builds from Megatron-LM, and it never reads a file of the held-out cases."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tools" / "build_memory_dev.py"
DATA = REPO / "tests" / "data" / "memory_dev" / "memory_dev.json"


def _tool():
    spec = importlib.util.spec_from_file_location("build_memory_dev", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_held_out_case_is_in_the_dev_set():
    tool = _tool()
    assert len(tool.HELD_OUT) == 12
    names = {case["name"].removeprefix(tool.SUITES[case["suite"]]) for case in json.loads(DATA.read_text())}
    assert not names & tool.HELD_OUT


@pytest.fixture(scope="module")
def built(megatron_lm_mirror):
    tool = _tool()
    asked: list[list[str]] = []
    git = tool.git

    def recording(checkout, *args):
        asked.append(list(args))
        return git(checkout, *args)

    tool.git = recording
    items, left_out = tool.build(megatron_lm_mirror)
    return tool, items, left_out, asked


@pytest.mark.timeout(600)
def test_the_shipped_set_is_what_the_tool_builds(built):
    tool, items, left_out, _ = built
    shipped = json.loads(DATA.read_text())
    head = shipped[0]["provenance"]["head"]
    if items[0]["provenance"]["head"] != head:
        pytest.skip(f"the mirror's HEAD is not {head[:10]}, the commit the shipped set was built from")
    assert items == shipped
    assert dict(left_out)["gpt3_15b_8t_release_sm_gb200"].startswith("its H100 memory values came with the case")


@pytest.mark.timeout(600)
def test_no_file_of_a_held_out_case_is_read(built):
    tool, _, left_out, asked = built
    assert {case for case, why in left_out if why.startswith("held out")} == tool.HELD_OUT
    for args in asked:
        for arg in args:
            parts = set(re.split(r"[/:]", arg))
            assert not parts & tool.HELD_OUT, args
