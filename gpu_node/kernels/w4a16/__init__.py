"""W4A16 matmuls, y = x @ W^T with INT4 weights: the tl.dot GEMM over Int4Weight (`dot`), the
CUDA-core GEMV over Int4WeightKN (`gemv`), and over Int4WeightMMA the tensor-core GEMV
(`mma`, its step `mma_step`, PTX `mma_asm`, launch plans `mma_plan` with the per-GPU
`mma_tuned.json`), the GEMMs past it (`mma_gemm`: `mma_gemm_tc`, `mma_gemm_dot`) and the
dequantization to a dense weight (`mma_dequant`); the torch reference of them all
(`reference`)."""
