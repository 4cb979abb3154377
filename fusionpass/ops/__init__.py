"""torch.library custom ops "fusionpass::<name>"; importing this package registers them."""
from fusionpass.ops import (  # noqa: F401
    attention,
    cross_entropy,
    decode_attention,
    flash_attention,
    layer_norm,
    rms_norm,
    rope,
    swiglu,
)
