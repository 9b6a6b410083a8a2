"""fuselab.settings: every environment variable in one place, each read at first use and kept."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fuselab import settings
from fuselab.kernels import _runtime

REPO = Path(__file__).resolve().parents[1]


def test_every_knob_is_listed_with_its_default(env):
    assert {k.env for k in settings.KNOBS} == {"FUSELAB_AUTOTUNE", "FUSELAB_CACHE_DIR", "FUSELAB_CUDA_KERNEL",
                                               "FUSELAB_EAGER_CPP", "FUSELAB_KEEP_TRITON_KEY", "TRITON_INTERPRET"}
    for knob in settings.KNOBS:
        env.delenv(knob.env, raising=False)
    settings.reload()
    assert settings.AUTOTUNE.get() is True
    assert settings.CACHE_DIR.get() == Path.home() / ".cache" / "fuselab"
    assert settings.CUDA_KERNEL.get() == "auto"
    assert settings.EAGER_CPP.get() is True
    assert settings.KEEP_TRITON_KEY.get() is True
    env.setenv("FUSELAB_CUDA_KERNEL", "")  # set but empty: the default, as the CUDA reference reads it
    settings.reload()
    assert settings.CUDA_KERNEL.get() == "auto"


def test_read_at_first_use_then_kept_until_reload(env, tmp_path):
    env.setenv("FUSELAB_CACHE_DIR", str(tmp_path / "first"))
    env.setenv("FUSELAB_AUTOTUNE", "off")
    settings.reload()
    assert settings.CACHE_DIR.get() == tmp_path / "first" and settings.AUTOTUNE.get() is False
    env.setenv("FUSELAB_CACHE_DIR", str(tmp_path / "second"))
    env.setenv("FUSELAB_AUTOTUNE", "1")
    assert settings.CACHE_DIR.get() == tmp_path / "first", "read again on a later call"
    settings.reload()
    assert settings.CACHE_DIR.get() == tmp_path / "second" and settings.AUTOTUNE.get() is True


def test_cache_dir_expands_home(env):
    env.setenv("FUSELAB_CACHE_DIR", "~/somewhere")
    settings.reload()
    assert settings.CACHE_DIR.get() == Path.home() / "somewhere"


@pytest.mark.parametrize("name,value,words", [
    ("FUSELAB_AUTOTUNE", "maybe", ["FUSELAB_AUTOTUNE", "'maybe'"]),
    ("FUSELAB_CUDA_KERNEL", "fastest", ["FUSELAB_CUDA_KERNEL", "auto, mma or wgmma", "'fastest'"]),
])
def test_bad_value_names_the_variable(env, name, value, words):
    env.setenv(name, value)
    settings.reload()
    knob = next(k for k in settings.KNOBS if k.env == name)
    with pytest.raises(ValueError) as info:
        knob.get()
    for w in words:
        assert w in str(info.value)


def test_triton_interpret_is_fixed_for_the_process(env):
    # Triton decided interpreted or compiled kernels when fuselab defined them: reload keeps it.
    env.setenv("TRITON_INTERPRET", "0" if _runtime.INTERPRET else "1")
    settings.reload()
    assert settings.TRITON_INTERPRET.get() is _runtime.INTERPRET


IMPORT_IN_A_FRESH_PROCESS = '''
import os
import torch
def fail(*args, **kwargs):
    raise AssertionError("import fuselab initialized CUDA")
torch.cuda.is_available = lambda: True  # as on a GPU machine, where the device name would be read
for name in ("init", "_lazy_init", "get_device_name", "get_device_properties", "get_device_capability",
             "current_device", "device_count"):
    setattr(torch.cuda, name, fail)
os.environ.update(FUSELAB_AUTOTUNE="not read", FUSELAB_CUDA_KERNEL="not read")
import fuselab, fuselab.nn, fuselab.optim
from fuselab import settings
assert not torch.cuda.is_initialized()
assert set(settings._values) <= {"TRITON_INTERPRET"}, settings._values
'''


def test_import_reads_no_setting_and_does_not_initialize_cuda():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, as on a GPU
    run = subprocess.run([sys.executable, "-c", IMPORT_IN_A_FRESH_PROCESS], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
