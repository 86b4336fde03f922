"""The bundled llama-cpp-python copy's rewrites (:mod:`dflash_gguf.build.bundle`): every import of ``llama_cpp``
becomes one of ``dflash_gguf._llama_cpp``, the loaders read the renamed libraries and their own variable."""
from __future__ import annotations

import pytest

from dflash_gguf.build import bundle

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("line, want", [
    ("import llama_cpp", "import dflash_gguf._llama_cpp as llama_cpp"),
    ("import llama_cpp.llama_cpp as llama_cpp", "import dflash_gguf._llama_cpp.llama_cpp as llama_cpp"),
    ("    import llama_cpp.mtmd_cpp as mtmd_cpp", "    import dflash_gguf._llama_cpp.mtmd_cpp as mtmd_cpp"),
    ("import llama_cpp.llama", "import dflash_gguf._llama_cpp.llama\nimport dflash_gguf._llama_cpp as llama_cpp"),
    ("from llama_cpp.llama_types import List", "from dflash_gguf._llama_cpp.llama_types import List"),
    ("from llama_cpp._ctypes_extensions import (", "from dflash_gguf._llama_cpp._ctypes_extensions import ("),
    ("from llama_cpp import Llama", "from dflash_gguf._llama_cpp import Llama"),
])
def test_imports_of_llama_cpp_become_imports_of_the_bundled_copy(line, want):
    assert bundle.rewrite_imports(line + "\n") == want + "\n"


@pytest.mark.parametrize("line", [
    "from .llama_cpp import *",                             # relative: already inside the copy
    'x: "llama_cpp.llama.LlamaState" = None',               # annotations and attribute use are not imports
    "import llama_cpp_extra",                               # another package
    "    >>> import llama_cpp",                             # a docstring's example
])
def test_what_is_not_an_import_of_llama_cpp_is_left_alone(line):
    assert bundle.rewrite_imports(line + "\n") == line + "\n"


def test_the_loaders_load_the_renamed_libraries_and_read_their_own_variable():
    src = '_lib_base_name = "llama"\n_override_base_path = os.environ.get("LLAMA_CPP_LIB_PATH")\n'
    out = bundle.rewrite_loader(src, "llama_cpp.py")
    assert '"dflash_llama"' in out and "DFLASH_GGUF_LIB_PATH" in out and "LLAMA_CPP_LIB_PATH" not in out
    out = bundle.rewrite_loader('libggml = ctypes_ext.load_shared_library("ggml", libggml_base_path)\n', "_ggml.py")
    assert 'load_shared_library("dflash_ggml", ' in out
    with pytest.raises(bundle.BundleError, match="not the pinned llama-cpp-python"):
        bundle.rewrite_loader("# another release\n", "llama_cpp.py")


@pytest.mark.parametrize("name, base", [("libllama.so", "llama"), ("libggml-cpu.so.0", "ggml-cpu"),
                                        ("libggml-base.so.0.25.3", "ggml-base"), ("libllama.dylib", "llama"),
                                        ("libggml.0.dylib", "ggml"), ("README.md", None), ("llama.py", None)])
def test_a_library_is_known_by_its_base_name_whatever_its_version_suffix(name, base):
    assert bundle._soname_base(name) == base
