"""A STAND-IN for sglang-kernel (sgl_kernel): bench/engine_probe_device.py --stub copies it in.

The real package is too large to carry to the bench machine; on a GPU host it is installed
beside SGLang. Any attribute or submodule exists; calling one raises. It lets a probe with the
GPUs visible get past `import sgl_kernel`, to see what the rest of validation does on the GPU.
"""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


def _missing(name):
    def call(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel stand-in: {name} was called")
    return call


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


__path__ = []
sys.meta_path.append(_Finder())
