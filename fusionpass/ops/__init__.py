"""torch.library custom ops "fusionpass::<name>"; importing this package registers them: the shared
modules here and every fusion folder's op modules (fusionpass.fusions), so a new op needs no list
to be added to."""
import importlib as _importlib
import pkgutil as _pkgutil

from fusionpass import fusions as _fusions

for _info in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_info.name}")
_fusions.modules("op")

from fusionpass.ops.autocast import make_neutral as _make_neutral  # noqa: E402

_make_neutral()
