"""Runtime overhead: pipeplan's engine against plain PyTorch and hand-built torch.distributed.pipelining."""
