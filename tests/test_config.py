"""One configuration: every ``PXN_*`` variable the library reads is an ``EngineConfig`` field, read and parsed in
``transport/config.py`` only, and marked operational or tuning."""
import pathlib
import re

import pytest

import transport.config
from transport.config import OPERATIONAL, OTHER_VARIABLES, TUNING, EngineConfig
from transport.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ("transport", "integration", "pxn_kernels")
# Variables that are not an engine's setting, and why each is read where it is (config.py says so too)
NOT_ENGINE = OTHER_VARIABLES
# a read of the environment naming a PXN_ variable: os.environ.get("PXN_..."), environ["PXN_..."], getenv(...)
ENV_READ = re.compile(r"""(?:environ(?:\.get)?|getenv)\s*[\(\[]\s*["'](PXN_[A-Z0-9_]+)""")


def _sources():
    for folder in LIBRARY:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_every_library_variable_is_an_engine_config_field():
    declared = {var for var, _ in EngineConfig.variables().values()}
    named = set()
    for path in _sources():
        named |= set(re.findall(r"\bPXN_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    missing = sorted(named - declared - set(NOT_ENGINE))
    assert not missing, f"PXN_* variables named in the library but not EngineConfig fields: {missing}"


def test_the_module_docstring_names_each_variable_that_is_not_a_field():
    assert set(NOT_ENGINE) == {"PXN_KERNEL_POLICY", "PXN_SGLANG_PLUGIN", "PXN_SHAPES"}
    for var, where in NOT_ENGINE.items():
        module = where.split(":")[0]
        assert f"``{var}`` is read by" in transport.config.__doc__ and module in transport.config.__doc__, var


def test_variables_are_read_in_config_only():
    readers = []
    for path in _sources():
        if path.name == "config.py" and path.parent.name == "transport":
            continue
        for var in ENV_READ.findall(path.read_text()):
            if var not in NOT_ENGINE:
                readers.append(f"{path.relative_to(ROOT)}: {var}")
    assert not readers, f"environment reads outside transport/config.py (use EngineConfig.read): {readers}"


def test_each_field_has_one_variable_and_a_kind():
    variables = EngineConfig.variables()
    names = [var for var, _ in variables.values()]
    assert len(names) == len(set(names)), f"a variable serves two fields: {names}"
    assert {kind for _, kind in variables.values()} == {OPERATIONAL, TUNING}
    assert variables["secret"] == ("PXN_SECRET", OPERATIONAL) and variables["coalesce_bytes"][1] == TUNING


def test_the_secret_never_shows():
    cfg = EngineConfig.from_env({"PXN_SECRET": "s3cret-value-0123456789"})
    assert cfg.secret == "s3cret-value-0123456789"
    assert "s3cret" not in repr(cfg) and "s3cret" not in str(cfg)


@pytest.mark.parametrize("env, text", [
    ({"PXN_GID_INDEX": "-1"}, "PXN_GID_INDEX='-1'"),
    ({"PXN_ACK_SPIN_US": "2000000"}, "PXN_ACK_SPIN_US='2000000'"),
    ({"PXN_METADATA_TTL": "0"}, "PXN_METADATA_TTL='0'"),
    ({"PXN_INSECURE": "1", "PXN_TIMEOUT": "soon"}, "PXN_TIMEOUT='soon'"),
])
def test_bad_variables_are_named(env, text):
    with pytest.raises(ConfigError, match=re.escape(text)):
        EngineConfig.from_env(env)


def test_read_takes_only_the_names_asked_for():
    env = {"PXN_GID_INDEX": "3", "PXN_ACK_SPIN_US": "20", "PXN_RAILS": "not a number"}
    assert EngineConfig.read(("gid_index", "ack_spin"), env) == {"gid_index": 3, "ack_spin": 20e-6}
    with pytest.raises(ConfigError, match="PXN_RAILS='not a number'"):
        EngineConfig.read(("rails",), env)
