"""Wheel build hook: ``pip install .`` (or of an sdist) builds the patched llama.cpp into the wheel.

The wheel carries its own llama-cpp-python copy as ``dflash_gguf._llama_cpp`` (:mod:`dflash_gguf.build.bundle`
says why and how), so one install command leaves a working engine beside whatever ``llama_cpp`` the
environment already has. The build itself is :mod:`dflash_gguf.build.native`'s, cached in
``~/.cache/dflash-gguf`` (``DFLASH_GGUF_CACHE``): a reinstall of the same patch series takes seconds.

pip shows a build backend's output only with ``-v``; the build's progress lines also go to the terminal
(``/dev/tty``) when there is one, since a first build takes minutes. ``DFLASH_GGUF_NO_BUNDLE=1`` builds a
wheel without the copy (development environments install the patched llama-cpp-python themselves:
``make build``); an editable install never bundles.
"""
from __future__ import annotations

import logging
import os
import sys
import sysconfig
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


def _progress_handler() -> logging.Handler:
    try:
        stream = open("/dev/tty", "w", buffering=1)   # noqa: SIM115 (lives as long as the build)
    except OSError:
        stream = sys.stderr
    h = logging.StreamHandler(stream)
    h.setFormatter(logging.Formatter("dflash-gguf build %(asctime)s: %(message)s", "%H:%M:%S"))
    return h


class NativeBundleHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel" or version == "editable" or os.environ.get("DFLASH_GGUF_NO_BUNDLE") == "1":
            return
        sys.path.insert(0, self.root)
        try:
            from dflash_gguf.build import native as build
            from dflash_gguf.build import bundle
        finally:
            sys.path.remove(self.root)
        handler = _progress_handler()
        for name in ("dflash_gguf.build.native", "dflash_gguf.build.bundle"):
            lg = logging.getLogger(name)
            lg.addHandler(handler)
            lg.setLevel(logging.INFO)
        try:
            wheel = bundle.patched_wheel()
            pkg = bundle.bundle(wheel, Path(self.directory) / "bundle")
        except (build.BuildError, bundle.BundleError) as e:
            raise SystemExit(f"dflash-gguf: building the patched llama.cpp failed:\n{e}") from None
        build_data["force_include"][str(pkg)] = f"dflash_gguf/{bundle.PACKAGE}"
        # native libraries inside: a platform wheel (any Python 3, this machine's platform)
        build_data["pure_python"] = False
        build_data["tag"] = "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")
