"""Make PyPI's torchvision importable beside torch's CPU wheel (test oracles only).

PyPI's torchvision is a CUDA build whose compiled ops fail to load next to `torch==2.13.0+cpu`, and
its import then dies registering fake kernels for those missing ops ("operator torchvision::nms does
not exist"); transformers imports it whenever it is installed. The oracles use only its pure-torch
transforms (resize, pad), so on the first `import torchvision` those registrations are skipped. A
meta-path hook: nothing (not even torch) is imported until something imports torchvision.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


class _Loader(importlib.abc.Loader):
  def __init__(self, inner):
    self.inner = inner

  def create_module(self, spec):
    return self.inner.create_module(spec)

  def exec_module(self, module):
    import torch  # noqa: PLC0415
    orig = torch.library.register_fake

    def register_fake(op, *a, **k):
      if isinstance(op, str) and op.startswith("torchvision::"):
        return lambda fn: fn
      return orig(op, *a, **k)

    torch.library.register_fake = register_fake
    try:
      import warnings  # noqa: PLC0415
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Failed to load image Python extension"
        self.inner.exec_module(module)
    finally:
      torch.library.register_fake = orig


class _Finder(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name != "torchvision":
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is not None and spec.loader is not None:
      spec.loader = _Loader(spec.loader)
    return spec


def install() -> None:
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
