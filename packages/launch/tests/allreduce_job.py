"""A trainer-rank stand-in for runner tests: one gloo all-reduce across every torchrun rank."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {value.item()}", flush=True)
dist.destroy_process_group()
