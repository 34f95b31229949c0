"""One experiment, both ways: `launch EXP` (charllm's workload) and `launch EXP --runner megatron-lm`
(Megatron-LM's own pretrain_gpt.py at core_v0.16.1, the flags `export megatron` writes), on the tiny
layouts with 2 CPU processes, the same seed and the same data (a Megatron indexed dataset both read
through megatron-core's GPTDataset): the same losses, step by step.

What keeps them apart is said where it does: charllm's workload logs each step's own loss, and
probes.store.trainlogs takes Megatron-LM's first line (which it does not reset) out of its second."""

from __future__ import annotations

import numpy as np
import pytest

from charllm.engine.launch.command import megatron_lm_command
from charllm.engine.launch.launcher import launch
from charllm.engine.launch.targets import LOCAL
from charllm.engine.model.experiment import Experiment
from charllm.probes.store.rundir import RunDir
from infra_megatron_lm import megatron_lm_checkout  # noqa: F401 - fixture
from infra_runs import logs, wait_final

pytestmark = [pytest.mark.integration, pytest.mark.train]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """A Megatron indexed dataset of 400 documents of 128 tokens, each a phrase of 16 repeated (a
    pattern the tiny model learns within the run)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("tokens") / "phrases")
    rng = np.random.default_rng(7)
    phrases = rng.integers(0, 1000, size=(8, 16))
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in range(400):
        text = np.tile(np.roll(phrases[doc % 8], doc % 16), 8).astype(np.int32)
        builder.add_document(torch.from_numpy(text), [len(text)])
    builder.finalize(prefix + ".idx")
    return prefix


def losses(rd: RunDir) -> dict[int, float]:
    """Each step's loss as the run logged it (the workload's last rank, or Megatron-LM's line)."""
    manifest = wait_final(rd, 500)
    assert manifest["status"] == "completed", (manifest.get("failure"), logs(rd)[-3000:])
    return {r["iteration"]: r["loss"] for r in rd.iteration_records()
            if r.get("event") == "iteration" and r.get("loss") is not None}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("preset", ["tiny-local", "tiny-tp2", "tiny-pp2"])
def test_the_two_runners_train_to_the_same_losses(preset, tokens, megatron_lm_checkout):
    exp = Experiment.load(preset)
    exp.training.data_path = tokens
    exp.training.attention_backend = "unfused"   # Megatron's local layers compute attention unfused
    exp.telemetry.backend = "host"
    ours = losses(RunDir(launch(exp, LOCAL).run_dir))
    command, notes = megatron_lm_command(exp, str(megatron_lm_checkout), python=LOCAL.python_path, check_here=True)
    theirs = losses(RunDir(launch(exp, LOCAL, command=command, notes=notes).run_dir))
    steps = range(1, exp.training.train_iters + 1)
    assert sorted(ours) == sorted(theirs) == list(steps)
    print(f"\n{preset}: " + " ".join(f"{i}:{ours[i]:.5f}/{theirs[i]:.5f}" for i in steps))
    for i in steps:      # Megatron logs 6 significant digits
        assert theirs[i] == pytest.approx(ours[i], rel=2e-5, abs=2e-5), (i, ours[i], theirs[i])
    assert ours[exp.training.train_iters] < ours[1] - 0.1, "the pattern is learnt"
