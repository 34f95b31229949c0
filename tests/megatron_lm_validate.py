"""Give command lines to a Megatron-LM checkout's own argument code, as pretrain_gpt.py would.

Run with the checkout first on PYTHONPATH (tests/infra_megatron_lm.py does this). Reads a JSON list of
{"argv": [...], "env": {...}, "world_size": N} on stdin and prints one JSON object per case: "error"
(the exception Megatron raised, as `Type: message`), or the resolved arguments the tests look at
(WATCHED, or a case's "names"; with "parse_only", what parse_args alone gives).
Each case runs parse_args, validate_args and the tokenizer builder, the steps pretrain_gpt.py takes
before it needs a GPU. No GPU is needed: the few questions validate_args asks the device or Transformer
Engine are answered as on an H100 with a current Transformer Engine (NVIDIA's PyTorch container).
"""

import contextlib
import importlib.abc
import importlib.machinery
import io
import json
import os
import sys
import types
import typing


class _Anything:
    """Whatever triton's module-level code asks for: decorators return what they wrap."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Anything()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __getitem__(self, key):
        return _Anything()


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        # Capitalized names are used as classes (isinstance, subclassing, triton.Config(...)).
        value = type(name, (), {"__init__": lambda self, *a, **k: None}) \
            if name.lstrip("_")[:1].isupper() else _Anything()
        setattr(self, name, value)
        return value


class _TritonFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """triton has no CPU wheel; megatron-core imports it at module level for GPU kernels."""

    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "3.4.0"
        return module

    def exec_module(self, module):
        pass


def _prepare() -> None:
    sys.meta_path.insert(0, _TritonFinder())
    if not hasattr(typing, "override"):       # Python 3.12's; megatron-core >= 0.18 imports it
        typing.override = lambda f: f
    import torch

    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)     # H100
    from megatron.training import arguments

    arguments.get_device_arch_version = lambda: 9
    arguments.is_te_min_version = lambda *a, **k: True


WATCHED = ("world_size", "data_parallel_size", "padded_vocab_size", "ckpt_format", "tokenizer_type",
           "vocab_size", "data_parallel_sharding_strategy", "use_megatron_fsdp", "use_torch_fsdp2",
           "use_distributed_optimizer", "sequence_parallel", "transformer_impl", "spec", "train_iters",
           "global_batch_size", "micro_batch_size", "num_layers", "hidden_size", "ffn_hidden_size",
           "seq_length", "max_position_embeddings", "tensor_model_parallel_size", "pipeline_model_parallel_size",
           "gradient_accumulation_fusion", "untie_embeddings_and_output_weights")


def _run(case: dict) -> dict:
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args

    saved = dict(os.environ)
    os.environ.update({"WORLD_SIZE": str(case["world_size"]), "RANK": "0", "LOCAL_RANK": "0", **case["env"]})
    sys.argv = ["pretrain_gpt.py", *case["argv"]]
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            args = parse_args()
            if not case.get("parse_only"):
                validate_args(args, {})
                global_vars.rebuild_tokenizer(args)
        return {name: _plain(getattr(args, name, None)) for name in case.get("names", WATCHED)}
    except SystemExit as exc:          # argparse: an unknown flag or a bad value
        lines = err.getvalue().strip().splitlines()
        return {"error": f"SystemExit: {lines[-1] if lines else exc.code}"}
    except Exception as exc:           # noqa: BLE001 - every refusal is a result here
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _plain(value):
    return value if isinstance(value, (int, float, str, bool, list, type(None))) else str(value)


if __name__ == "__main__":
    cases = json.load(sys.stdin)
    _prepare()
    results = [_run(case) for case in cases]
    sys.stdout.write(json.dumps(results) + "\n")
