"""MoE kernels: the router in one launch (`router`), expert slots (`slots`), the experts as
grouped INT4 GEMMs (`grouped`), on tensor cores over slots (`mma`) or as float GEMVs
(`dense`), and the torch reference every one of them is compared with (`reference`)."""
