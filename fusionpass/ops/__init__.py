"""torch.library custom ops "fusionpass::<name>"; importing this package registers them."""
from fusionpass.ops import attention, cross_entropy, flash_attention, layer_norm, rms_norm  # noqa: F401
from fusionpass.ops import rope  # noqa: E402, F401
from fusionpass.ops import swiglu  # noqa: E402, F401
