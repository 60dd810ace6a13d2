"""Native CPU kernels for the reference engine (built with the system C compiler at first use):
linear.py dispatches y = x @ w^T between small_gemm.c and F.linear; build.py compiles and caches."""
