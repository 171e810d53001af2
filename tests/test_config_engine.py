"""``TransferEngine(config=EngineConfig(...))``: the settings as one record beside the keywords. The record is used
as it is (no ``PXN_*`` variable is read into it), a setting keyword given beside it replaces its field, and every
refusal names the bad value."""
import numpy as np
import pytest

from transport.auth import InsecureConfig
from transport.config import EngineConfig
from transport.engine import TransferEngine
from transport.errors import ConfigError


def test_a_config_is_used_as_it_is_and_moves_bytes(monkeypatch, seed):
    monkeypatch.setenv("PXN_RAILS", "3")
    monkeypatch.setenv("PXN_COALESCE_BYTES", "1K")
    cfg = EngineConfig(fabric="tcp", rails=1, coalesce_bytes="16K")
    with TransferEngine(config=cfg) as a, TransferEngine(fabric="tcp", rails=1) as b:
        assert a.config == cfg and a.rails == 1 and a.config.coalesce_bytes == 16 << 10
        assert b.config.coalesce_bytes == 1 << 10  # the keywords' engine reads the variables
        rng = np.random.default_rng(seed)
        n = 3 * (1 << 16) + 5
        src = rng.integers(0, 256, n, dtype=np.uint8)
        dst = np.full(n + 32, 0x5A, dtype=np.uint8)
        a.register(src)
        b.register(dst)
        lens = [7, 16383, 16385, n - 7 - 16383 - 16385]
        offs = np.concatenate(([0], np.cumsum(lens)[:-1])).tolist()
        a.batch_write(b.session_id, [src.ctypes.data + o for o in offs], [dst.ctypes.data + 9 + o for o in offs],
                      lens)
        assert np.array_equal(dst[9:9 + n], src) and (dst[:9] == 0x5A).all() and (dst[9 + n:] == 0x5A).all()


def test_a_keyword_beside_a_config_replaces_its_field():
    cfg = EngineConfig(fabric="tcp", rails=1, timeout=7.0)
    with TransferEngine(config=cfg, rails=2, coalesce_bytes="8K") as e:
        assert (e.rails, e.config.rails, e.config.coalesce_bytes, e.config.timeout) == (2, 2, 8 << 10, 7.0)
    assert cfg.rails == 1  # the caller's record is not changed


def test_the_keywords_and_their_config_build_the_same_engine(monkeypatch):
    monkeypatch.setenv("PXN_LANES", "3")
    with TransferEngine(fabric="tcp", rails=1, stripe_bytes="1M") as by_keywords:
        with TransferEngine(config=by_keywords.config) as by_config:
            assert by_config.config == by_keywords.config and by_config.config.lanes == 3


@pytest.mark.parametrize("kwargs,error,words", [
    ({"config": {"rails": 1}}, TypeError, ["config must be a transport.config.EngineConfig", "dict"]),
    ({"config": EngineConfig(fabric="tcp"), "rails": 0}, ConfigError, ["rails must be an int >= 1", "0"]),
    ({"config": EngineConfig(fabric="tcpx")}, ConfigError, ["fabric must be one of", "'tcpx'"]),
    ({"config": EngineConfig(fabric="tcp"), "rail": 1}, TypeError, ["unexpected keyword argument 'rail'"]),
    ({"config": EngineConfig(fabric="tcp", secret="short")}, InsecureConfig, ["too short"]),
])
def test_refusals_name_the_bad_value(kwargs, error, words):
    with pytest.raises(error) as e:
        TransferEngine(**kwargs)
    for w in words:
        assert w in str(e.value)
