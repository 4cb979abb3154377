"""torch.library custom ops "fusionpass::<name>"; importing this package registers them."""
from fusionpass.ops import attention, cross_entropy, layer_norm, rms_norm  # noqa: F401
