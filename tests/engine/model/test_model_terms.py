"""The speed and memory models' terms one by one, each against a value worked out by hand from the published
formula it cites (issue 40: compensating errors between terms show only in aggregates otherwise).

Each test states the formula and its source; the expected numbers are computed here from that formula, not
from the function under test. The model's own assumed constants (fill time, link efficiency, latencies) are
read from engine.model.speed, so that a test checks the formula, not the value of an assumption.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest

from charllm.engine.model import memory, speed
from charllm.engine.model.experiment import Cluster, Experiment, Hardware, ModelSpec, Parallel, Training

GB = 1e9


def hand_rates(*, sms: int = 0) -> speed.Rates:
    """Round figures, so that every expected value below is easy to follow: a 1000 TFLOP/s peak at half of it,
    2 TB/s of memory, 400 GB/s in a node of 8 devices, 50 GB/s of network per device."""
    return speed.Rates(matmul_flops=1000e12, matmul=0.5, memory_bps=2000 * GB, node_bps=400 * GB,
                       network_bps=50 * GB, host_bps=50 * GB, gpus_per_node=8, sms=sms, source="test")


def gpt(*, h=4096, heads=32, layers=8, seq=4096, mbs=1, tp=1, pp=1, vp=None, sp=False, dp=1, gbs=None,
        **training) -> Experiment:
    """A GPT-3-style model (LayerNorm, biases, GELU MLP of 4h, multi-head attention) on H100s."""
    world = tp * pp * dp
    return Experiment(
        model=ModelSpec(num_layers=layers, hidden_size=h, ffn_hidden_size=4 * h, num_attention_heads=heads,
                        seq_length=seq, max_position_embeddings=seq, vocab_size=50257, hidden_dropout=0.0,
                        attention_dropout=0.0),
        hardware=Hardware.load("h100-sxm-80gb"),
        cluster=Cluster(nodes=1, gpus_per_node=world),
        parallel=Parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vp, sequence_parallel=sp),
        training=Training(micro_batch_size=mbs, global_batch_size=gbs or mbs * dp, **training),
    )


# --------------------------------------------------------------------------------------------
# GEMMs
# --------------------------------------------------------------------------------------------
def test_a_large_gemm_takes_its_2mkn_flops_at_the_achieved_rate_plus_its_fill():
    """An (m x k) @ (k x n) GEMM is 2mkn FLOPs (a multiply and an add per term: Narayanan et al. 2021,
    'Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM', arXiv:2104.04473,
    sec. 5.1)."""
    r = hand_rates()
    m = k = n = 8192
    flops = 2 * 8192**3                                        # 1.0995e12
    expected = flops / (1000e12 * 0.5) + speed.MATMUL_FILL_S   # 2.199 ms + the fill
    got = float(speed._gemm(np, m, k, n, r.matmul_flops, r.matmul, r, 2))
    assert got == pytest.approx(expected, rel=1e-12)
    assert got == pytest.approx(2.2046e-3, rel=1e-4)


def test_a_thin_gemm_is_bound_by_streaming_its_operands_from_memory():
    """Roofline (Williams et al. 2009, 'Roofline: an insightful visual performance model'): a GEMM of one
    row reads its k x n weight and cannot finish before those bytes have crossed the memory bus."""
    r = hand_rates()
    m, k, n, ab = 1, 8192, 8192, 2
    streamed = (m * k + k * n + m * n) * ab / (2000 * GB * speed.MEMORY_EFFICIENCY)   # 89.5 µs
    compute = 2 * m * k * n / (1000e12 * 0.5) + speed.MATMUL_FILL_S                   # 5.8 µs
    assert streamed > compute
    got = float(speed._gemm(np, m, k, n, r.matmul_flops, r.matmul, r, ab))
    assert got == pytest.approx(streamed + speed.KERNEL_S, rel=1e-12)


def test_a_wave_quantized_gemm_fills_the_sms_of_its_best_tile_shape():
    """Wave quantization (NVIDIA, 'Matrix Multiplication Background User's Guide', sec. 'Wave Quantization'):
    a GEMM's output tiles run in waves of one tile per SM. 133 tiles of 128x256 on 132 SMs take 2 waves
    (133/264 of the slots busy); as 128x128 tiles they are 266, 3 waves, 266/396 busy: the better."""
    m, n = 128 * 133, 256
    assert float(speed._waves(np, m, n, 1, 132)) == pytest.approx(266 / 396)
    r = hand_rates(sms=132)
    flops = 2 * m * 8192 * n
    expected = flops / (1000e12 * 0.5) / (266 / 396) + speed.MATMUL_FILL_S
    assert float(speed._gemm(np, m, 8192, n, r.matmul_flops, r.matmul, r, 2)) == pytest.approx(expected)


# --------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("collective, factor", [
    ("all-reduce", lambda n: 2 * (n - 1) / n),
    ("all-gather", lambda n: (n - 1) / n),
])
def test_a_collective_in_a_node_moves_its_ring_bus_bytes_over_the_device_link(collective, factor):
    """A ring all-reduce sends 2(n-1)/n of the buffer per rank, an all-gather or reduce-scatter (n-1)/n
    (NCCL's bus bandwidth: nccl-tests doc/PERFORMANCE.md; Patarasuk and Yuan 2009 for the ring)."""
    r = hand_rates()
    nbytes, n = 1e9, 8
    expected = speed.LATENCY_NODE_S + factor(n) * nbytes / (400 * GB * speed.LINK_EFFICIENCY)
    got = float(speed._collective(np, factor(n), nbytes, n, 1, r))
    assert got == pytest.approx(expected, rel=1e-12)
    if collective == "all-reduce":
        assert got == pytest.approx(20e-6 + 1.75 * 1e9 / 320e9, rel=1e-12)      # 5.49 ms


def test_a_collective_across_nodes_runs_at_the_network_share_of_the_members_on_each_node():
    """Across nodes a ring crosses the network: each node's members share their NICs' bandwidth (one NIC a
    device, rail-optimized); the latency, the model's own assumption, adds LATENCY_NETWORK_S per doubling of
    the nodes."""
    r = hand_rates()
    n, nbytes = 16, 1e9                                   # 2 nodes of 8
    factor = 2 * (n - 1) / n
    bw = min(400 * GB, 8 * 50 * GB) * speed.LINK_EFFICIENCY   # 8 members x 50 GB/s: 400 GB/s, then 80%
    expected = speed.LATENCY_NETWORK_S * math.log2(2) + factor * nbytes / bw
    assert float(speed._collective(np, factor, nbytes, n, 1, r)) == pytest.approx(expected, rel=1e-12)
    # a data-parallel group 8 ranks apart (TP 8) has one member per node: one device's network share
    stride, n = 8, 4
    factor = 2 * (n - 1) / n
    expected = speed.LATENCY_NETWORK_S * math.log2(4) + factor * nbytes / (50 * GB * speed.LINK_EFFICIENCY)
    assert float(speed._members_per_node(np, n, stride, 8)) == 1
    assert float(speed._collective(np, factor, nbytes, n, stride, r)) == pytest.approx(expected, rel=1e-12)
    assert float(speed._collective(np, factor, nbytes, 1, 1, r)) == 0.0        # a group of one sends nothing


def test_an_all_to_all_sends_each_token_to_its_topk_experts_ranks():
    """Expert-parallel all-to-all (GShard, Lepikhin et al. 2020; megatron-core's alltoall dispatcher): each
    of a rank's token-expert pairs goes to the expert's rank, so of topk x tokens a share (local - 1)/size
    stays in the node and (size - local)/size crosses the network; the slower side sets the time."""
    r = hand_rates()
    token_bytes, topk, size = 1e8, 2, 16                  # EP 16 over 2 nodes of 8
    inside = token_bytes * topk * 7 / 16                  # 87.5 MB over NVLink
    outside = token_bytes * topk * 8 / 16                 # 100 MB over the network
    seconds = max(inside / (400 * GB * speed.ALL_TO_ALL_EFFICIENCY), outside / (50 * GB * speed.ALL_TO_ALL_EFFICIENCY))
    expected = speed.LATENCY_NETWORK_S + seconds          # the network side: 3.33 ms
    assert float(speed._all_to_all(np, token_bytes, topk, size, 1, r)) == pytest.approx(expected, rel=1e-12)
    # EP 8 in one node: all of it over NVLink, 7/8 of the pairs leave the rank
    expected = speed.LATENCY_NODE_S + token_bytes * topk * 7 / 8 / (400 * GB * speed.ALL_TO_ALL_EFFICIENCY)
    assert float(speed._all_to_all(np, token_bytes, topk, 8, 1, r)) == pytest.approx(expected, rel=1e-12)


def test_the_flex_dispatcher_sends_a_token_once_to_each_rank_and_node_of_its_experts():
    """DeepEP (and HybridEP) deduplicate: a token goes once to each rank holding one of its experts, and
    once to each other node. With experts spread evenly, a given rank of `size` holds none of topk experts
    with probability (1 - 1/size)^topk, so a token reaches (local - 1)(1 - (1 - 1/size)^topk) other ranks of
    its node, and (nodes - 1)(1 - (1 - 1/nodes)^topk) other nodes."""
    r = hand_rates()
    token_bytes, topk, size = 1e8, 8, 16
    inside = token_bytes * 7 * (1 - (15 / 16) ** 8)       # 2.83 other ranks of the node per token
    outside = token_bytes * 1 * (1 - (1 / 2) ** 8)        # 0.996 of the other node
    seconds = max(inside / (400 * GB * speed.ALL_TO_ALL_EFFICIENCY), outside / (50 * GB * speed.ALL_TO_ALL_EFFICIENCY))
    expected = speed.LATENCY_NETWORK_S + seconds
    got = float(speed._all_to_all(np, token_bytes, topk, size, 1, r, per_rank=True))
    assert got == pytest.approx(expected, rel=1e-12)
    # EP 8 in one node: the NVLink side alone, 7 x (1 - (7/8)^8) = 4.93 other ranks per token
    expected = speed.LATENCY_NODE_S + token_bytes * 7 * (1 - (7 / 8) ** 8) / (400 * GB * speed.ALL_TO_ALL_EFFICIENCY)
    assert float(speed._all_to_all(np, token_bytes, topk, 8, 1, r, per_rank=True)) == pytest.approx(expected, rel=1e-12)


def test_communication_beside_compute_costs_what_it_does_not_cover_and_the_sms_it_holds():
    r = hand_rates(sms=132)
    # 3 ms of communication beside 2 ms of compute: 1 ms exposed, and the 2 ms covered slowed by the
    # COMM_SMS of 132 SMs the communication kernels hold
    assert float(speed._beside(np, 3e-3, 2e-3, r)) == pytest.approx(1e-3 + 2e-3 * speed.COMM_SMS / 132)
    assert float(speed._beside(np, 1e-3, 5e-3, r)) == pytest.approx(1e-3 * speed.COMM_SMS / 132)


# --------------------------------------------------------------------------------------------
# One decoder layer (_unit_times)
# --------------------------------------------------------------------------------------------
FLASH = SimpleNamespace(unfused_attention=False, transformer="transformer_engine")


def _units(exp: Experiment, r: speed.Rates) -> dict:
    return speed._unit_times(np, exp, speed.layouts_of(exp), r, r, FLASH)


def test_a_dense_layers_matmuls_are_24bsh2_plus_the_causal_half_of_4bs2h():
    """Forward FLOPs of a GPT layer: 24bsh^2 in its four linears (QKV 6bsh^2, projection 2bsh^2, MLP of 4h
    16bsh^2) and 4bs^2h in attention's two batched GEMMs (Narayanan et al. 2021, sec. 5.1 and its appendix), of which a
    causal flash kernel computes half. The backward runs each linear twice (data and weight gradients) and
    the flash backward 2.5x its forward FLOPs."""
    exp = gpt()
    b, s, h = 1, 4096, 4096
    r = dataclasses.replace(hand_rates(), memory_bps=1e30)     # no element-wise time: the matmuls alone
    dense = _units(exp, r)["dense"]
    linears = 24 * b * s * h**2 / (1000e12 * 0.5) + 4 * speed.MATMUL_FILL_S        # four GEMMs
    grow = s / (s + speed.FLASH_HALF_SEQ)
    attention = 4 * b * s**2 * h / 2
    flash_fwd = attention / (1000e12 * speed.FLASH_EFFICIENCY[0] * grow) + speed.KERNEL_S
    flash_bwd = speed.FLASH_BACKWARD_FLOPS * attention / (1000e12 * speed.FLASH_EFFICIENCY[1] * grow) + speed.KERNEL_S
    fwd, bwd, _, _, matmul, _ = (float(np.asarray(x).ravel()[0]) for x in dense)
    assert fwd == pytest.approx(linears + flash_fwd, rel=1e-9)
    assert bwd == pytest.approx(2 * linears + flash_bwd, rel=1e-9)
    assert matmul == pytest.approx(3 * linears + flash_fwd + flash_bwd, rel=1e-9)


def test_tensor_parallel_layers_all_reduce_twice_forward_or_gather_and_scatter_four_times_with_sp():
    """Megatron's tensor parallelism: two all-reduces of the b x s x h activations in a layer's forward, one
    after each row-parallel linear (Shoeybi et al. 2019, 'Megatron-LM', sec. 3, fig. 4); with sequence
    parallelism each becomes an all-gather before the block and a reduce-scatter after it (Korthikanti et al.
    2022, 'Reducing Activation Recomputation in Large Transformer Models', sec. 4.2.2)."""
    tp, b, s, h, ab = 4, 1, 4096, 4096, 2
    r = hand_rates()
    nbytes = b * s * h * ab
    link = 400 * GB * speed.LINK_EFFICIENCY
    all_reduce = speed.LATENCY_NODE_S + 2 * (tp - 1) / tp * nbytes / link
    gather = speed.LATENCY_NODE_S + (tp - 1) / tp * nbytes / link
    plain = _units(gpt(tp=tp), r)["dense"]
    assert float(np.asarray(plain[2]).ravel()[0]) == pytest.approx(2 * all_reduce, rel=1e-12)
    sequence_parallel = _units(gpt(tp=tp, sp=True), r)["dense"]
    assert float(np.asarray(sequence_parallel[2]).ravel()[0]) == pytest.approx(4 * gather, rel=1e-12)


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pp, vp, microbatches", [(4, 1, 8), (4, 2, 8), (8, 1, 32), (2, 4, 4)])
def test_the_pipeline_bubble_is_p_minus_1_over_m_v_of_the_ideal_time(pp, vp, microbatches):
    """1F1B's bubble is (p - 1)/m of the ideal time, the interleaved schedule's (p - 1)/(m v) (Narayanan et al.
    2021, sec. 2.2.1-2.2.2), for stages that all take as long. Here every stage holds the same decoder layers
    (no embedding or loss), so the bubble over the busy time must be exactly that."""
    exp = gpt(layers=8 * pp * vp, pp=pp, vp=vp if vp > 1 else None, dp=1, gbs=microbatches)
    layouts = speed.layouts_of(exp)
    same = np.zeros_like(layouts.stages[:, :1])
    same[0, 0, speed.DENSE] = 8 * vp                      # one kind of stage, held by all pp ranks
    layouts = dataclasses.replace(layouts, stages=same, stage_count=np.asarray([[pp]], dtype=float),
                                  stage_rank=np.asarray([[0]], dtype=float))
    times = speed.step_times(exp, layouts)
    assert float(times.host_s[0]) == 0.0                  # the GPU sets the pace, not the host
    busy = float(times.compute_s[0]) + float(times.communication_s[0])   # (DP 1: no data-parallel sync in it)
    assert float(times.bubble_s[0]) / busy == pytest.approx((pp - 1) / (microbatches * vp), rel=1e-9)


# --------------------------------------------------------------------------------------------
# Memory: parameters and optimizer state
# --------------------------------------------------------------------------------------------
def test_a_gpt_layer_holds_12h2_plus_13h_parameters_and_tp_splits_all_but_the_replicated_ones():
    """A GPT layer (LayerNorm, biases, MLP of 4h) holds 12h^2 + 13h parameters (Narayanan et al. 2021,
    sec. 5.1: P = 12lh^2 (1 + 13/(12h) + (V + s)/(12lh))). Tensor parallelism splits the linears' weights and
    the column-parallel biases (QKV 3h, fc1 4h) by t and replicates the two LayerNorms (4h) and the row-parallel
    biases (projection and fc2, h each): Shoeybi et al. 2019, sec. 3."""
    h = 4096
    m = gpt(h=h).model
    dense, expert = memory.layer_params(m, moe=False)
    assert (dense, expert) == (12 * h * h + 13 * h, 0)
    t = 4
    assert memory.layer_params(m, moe=False, tp=t)[0] == (12 * h * h + 7 * h) // t + 6 * h
    # the whole model: its layers, the embeddings of V (padded to 128) and s positions, the final LayerNorm
    V, s, layers = 50304, 4096, m.num_layers
    published = 12 * layers * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * layers * h))
    assert memory.count_parameters(m) == round(published) + 2 * h


@pytest.mark.parametrize("dtype, table", [
    ("fp16", (4, 16)),          # fp16 parameters, fp16 gradients: 20, or 4 + 16/d
    ("bf16", (6, 12)),          # bf16 parameters, fp32 gradients: 18, or 6 + 12/d
    ("fp32", (8, 8)),           # fp32 parameters, fp32 gradients: 16, or 8 + 8/d
])
def test_bytes_per_parameter_are_megatrons_distributed_optimizer_table(dtype, table):
    """Megatron-Core's distributed optimizer guide (docs/source/api-guide/dist_optimizer.md): bytes per
    parameter without the distributed optimizer and with it over d data-parallel ranks."""
    replicated, sharded = table
    for d, distributed in ((1, False), (8, False), (8, True)):
        exp = gpt(dp=d, bf16=dtype == "bf16", fp16=dtype == "fp16")
        exp.parallel.use_distributed_optimizer = distributed
        pr = memory.precision(exp)
        shard = pr.dp_shard if pr.shard_optimizer else 1
        per_param = pr.weight + pr.grad + pr.optimizer / shard
        assert per_param == pytest.approx(replicated + sharded / (d if distributed else 1))
    # and what the plan puts on the rank (one stage, tied embedding: every parameter once)
    exp = gpt(dp=8, bf16=dtype == "bf16", fp16=dtype == "fp16")
    exp.parallel.use_distributed_optimizer = True
    stage = memory.estimate(exp).stages[0]
    n = memory.count_parameters(exp.model)
    assert (stage.weights + stage.gradients + stage.optimizer) / n == pytest.approx(replicated + sharded / 8,
                                                                                   rel=1e-6)


@pytest.mark.parametrize("distributed", [False, True])
def test_the_data_parallel_sync_all_reduces_the_grads_or_reduce_scatters_them_and_gathers_the_weights(distributed):
    """Without the distributed optimizer the fp32 main grads are all-reduced over the d data-parallel ranks
    (2(d-1)/d of them per rank, ring); with it they are reduce-scattered and the updated bf16 weights
    all-gathered, (d-1)/d each (Megatron-Core's distributed optimizer guide, docs/source/api-guide/
    dist_optimizer.md). A dense model has no expert grads, so no second collective. One stage at DP 8 in a
    node: nothing else is communicated, so that sync is the step's whole exposed communication."""
    exp = gpt(h=1024, heads=16, layers=4, seq=1024, dp=8, gbs=8)
    exp.parallel.use_distributed_optimizer = distributed
    times = speed.step_times(exp, speed.layouts_of(exp))
    n, d = memory.count_parameters(exp.model), 8
    link = exp.hardware.node_link_gbs * GB * speed.LINK_EFFICIENCY            # 450 GB/s of NVLink, 80%
    if distributed:
        expected = 2 * speed.LATENCY_NODE_S + (d - 1) / d * n * 4 / link + (d - 1) / d * n * 2 / link
    else:
        expected = speed.LATENCY_NODE_S + 2 * (d - 1) / d * n * 4 / link
    assert float(times.communication_s[0]) == pytest.approx(expected, rel=1e-12)
