"""Paged decode attention: the split-K kernel on tl.dot (`dot`, which also picks the variant),
the register-resident fp8 kernel on mma.sync (`mma`, its PTX in `mma_asm`), the merge of
their splits (`split_merge`) and the torch reference (`reference`)."""
