"""Under torchrun with 2 processes: FSDP2 with torch's own GradScaler, when the gradient shard of one rank
alone overflows. Every rank must skip the step and halve the scale; if one stepped, the shards of one
model would belong to different steps. Prints one line per rank: `rank R stepped S scale X`.

    torchrun --standalone --nproc_per_node=2 tests/fsdp_overflow.py
"""

import gc

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [parameter.full_tensor() for parameter in model.parameters()]
    scaler.scale(model(torch.ones(4, 8)).sum()).backward()
    if dist.get_rank() == 1:
        model.weight.grad.to_local()[0, 0] = float("inf")  # an overflow in rank 1's shard only
    scaler.step(optimizer)
    scaler.update()
    stepped = not all(torch.equal(a, b.full_tensor()) for a, b in zip(before, model.parameters(), strict=True))
    print(f"rank {dist.get_rank()} stepped {stepped} scale {scaler.get_scale()}\n", end="", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # FSDP's state holds the process group in reference cycles: free it before Python's shutdown, which
    # aborts on a gloo thread still alive (common/utils.py: run).
    gc.collect()
