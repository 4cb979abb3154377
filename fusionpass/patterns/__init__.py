"""Matching helpers that several fusions share: reading the pre-grad graph (`graph`), proving
attention masks (`masks`), SDPA's and eager attention's forms (`sdpa`, `eager_attention`), the
checks of every route to the attention kernels (`attention_kernel`), dropout, and autocast's
casts. The fusions themselves live in fusionpass.fusions."""
