"""torch.library custom ops "fusionpass::<name>"; importing this package registers them (every
module in it, so a new op module needs no list to be added to)."""
import importlib as _importlib
import pkgutil as _pkgutil

for _info in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_info.name}")

from fusionpass.ops.autocast import make_neutral as _make_neutral  # noqa: E402

_make_neutral()
