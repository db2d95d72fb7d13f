"""`deterministic: true`: the same bits from the same run, on CUDA too.

On a CPU, gpipe's training is deterministic as it stands. On a GPU it is not
by default: cuBLAS may pick its reduction order per call unless its workspace
is fixed, cuDNN autotunes (benchmark) and may use TF32, and some kernels (the
backward of an index, of attention) add with atomics. `enable` turns all of
that off for the process, as PyTorch's reproducibility notes say:

- CUBLAS_WORKSPACE_CONFIG=:4096:8, which cuBLAS reads when its first handle is
  made: set before the process's first matrix product on the GPU (a worker sets
  it as its stage is built; gpipe.Pipeline when it is made);
- torch.use_deterministic_algorithms(True): an op with no deterministic
  implementation raises, naming itself, rather than vary;
- cuDNN deterministic, benchmark off; TF32 off for matrix products and cuDNN.

It is a process-wide setting, as PyTorch's is. What it costs is in docs/gpu.md.
"""

from __future__ import annotations

import os

import torch

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE = ":4096:8"  # PyTorch's documented choice (":16:8" uses less memory, may be slower)


def enable() -> None:
    """Deterministic algorithms for this process, from now on (see the module's docstring)."""
    if os.environ.get(CUBLAS_ENV) not in (":4096:8", ":16:8"):
        os.environ[CUBLAS_ENV] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # TF32 off: fp32_precision since torch 2.9 (the older allow_tf32 flags may not be mixed with it).
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.fp32_precision = "ieee"


def enabled() -> bool:
    """Whether this process runs deterministic algorithms (`enable`, or the user's own call)."""
    return torch.are_deterministic_algorithms_enabled()
