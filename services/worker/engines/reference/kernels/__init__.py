"""Native CPU kernels for the reference engine (built with the system C compiler at first use):
linear.py dispatches y = x @ w^T between small_gemm.c and F.linear; attention.py runs decode and
draft-verification attention over the paged cache (paged_attn.c); build.py compiles and caches."""
