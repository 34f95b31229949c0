"""A tiny real trainer charllm did not write: a linear model fitted by SGD with torch, logging each step
as Megatron-LM's training_log formats it (megatron/training/training.py, core_v0.16.1), so that
`--log-format megatron` reads it. Its flags are Megatron's names (--micro-batch-size, --train-iters)."""

import argparse
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--micro-batch-size", type=int, required=True)
p.add_argument("--train-iters", type=int, default=5)
args = p.parse_args()
torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
truth = torch.randn(16, 1)
for i in range(1, args.train_iters + 1):
    start = time.perf_counter()
    x = torch.randn(args.micro_batch_size, 16)
    loss = torch.nn.functional.mse_loss(model(x), x @ truth)
    optimizer.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    optimizer.step()
    elapsed_ms = (time.perf_counter() - start) * 1000
    print(f" iteration {i:8d}/{args.train_iters:8d} | consumed samples: {i * args.micro_batch_size:12d} |"
          f" elapsed time per iteration (ms): {elapsed_ms:.1f} | learning rate: {0.05:.6E} |"
          f" global batch size: {args.micro_batch_size:5d} | lm loss: {loss.item():.6E} | loss scale: {1.0:.1f} |"
          f" grad norm: {norm.item():.3f} | number of skipped iterations: {0:3d} | number of nan iterations: {0:3d} |",
          flush=True)
