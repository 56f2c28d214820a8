"""joaderd's settings: flags, TOML, strict keys and values, the remote-listen guard, defaults."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from joader.address import resolve_address, socket_path
from joader.errors import InvalidArgumentError
from joader.server import config as config_module
from joader.server.config import ServerConfig, SourceConfig, load_config


@pytest.fixture(autouse=True)
def no_env_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOADER_ADDRESS", raising=False)


def write_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "joaderd.toml"
    path.write_text(text)
    return str(path)


def test_flags_give_sources_sizes_and_settings(tmp_path: Path) -> None:
    config = load_config(["--source", f"a={tmp_path}", "--source", f"b={tmp_path}",
                          "--image-size", "224", "--image-size", "b=128", "--cache-size", "2GiB",
                          "--workers", "3", "--listen", "127.0.0.1:7070"])
    assert [(s.name, s.image_size) for s in config.sources] == [("a", 224), ("b", 128)]
    assert config.cache_size_bytes == 2 * 2**30
    assert config.num_workers == 3
    assert config.listen == "127.0.0.1:7070"


def test_new_flags(tmp_path: Path) -> None:
    config = load_config(["--source", f"a={tmp_path}", "--listen", "0.0.0.0:7070", "--allow-remote",
                          "--ready-file", "~/ready.json", "--retry-failed-s", "0",
                          "--decode-timeout-s", "2.5", "--max-jobs", "8", "--log-level", "debug"])
    assert config.allow_remote is True
    assert config.ready_file == Path("~/ready.json").expanduser()
    assert config.retry_failed_s == 0.0 and config.decode_timeout_s == 2.5 and config.max_jobs == 8
    assert config.log_level == "DEBUG"


def test_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda pid: {3})  # pinned to one CPU
    config = load_config(["--source", f"a={tmp_path}"])
    assert config == ServerConfig(sources=(SourceConfig("a", tmp_path, 256),), num_workers=1)
    assert (config.allow_remote, config.ready_file, config.max_jobs) == (False, None, 1024)
    assert (config.retry_failed_s, config.decode_timeout_s, config.lease_s) == (60.0, None, 10.0)  # None: auto
    assert ServerConfig(sources=()).num_workers == 1  # the dataclass default follows affinity too


def test_toml_config_with_flags_winning(tmp_path: Path) -> None:
    path = write_toml(tmp_path, f'cache_size = "64MiB"\nworkers = 1\nimage_size = 96\n'
                                f'[sources.imagenet]\npath = "{tmp_path}"\nimage_size = 200\n'
                                f'[sources.small]\npath = "{tmp_path}"\n')
    config = load_config(["--config", path, "--workers", "2"])
    assert {s.name: s.image_size for s in config.sources} == {"imagenet": 200, "small": 96}
    assert config.cache_size_bytes == 64 * 2**20
    assert config.num_workers == 2


def test_every_toml_key(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'listen = "[::]:7070"\nallow_remote = true\ncache_size = 4096\n'
                                'workers = 2\nlease_s = 3\nlookahead_batches = 2\nimage_size = 64\n'
                                'seed = 5\nlog_level = "warning"\nretry_failed_s = 1.5\n'
                                'decode_timeout_s = 9\nmax_jobs = 3\nready_file = "/tmp/r.json"\n'
                                f'[sources.a]\npath = "{tmp_path}"\n')
    config = load_config(["--config", path])
    assert config == ServerConfig(
        sources=(SourceConfig("a", tmp_path, 64),), listen="[::]:7070", cache_size_bytes=4096,
        num_workers=2, autoscale=False, max_workers=2, lease_s=3.0, lookahead_batches=2, seed=5, log_level="WARNING",
        allow_remote=True, ready_file=Path("/tmp/r.json"), retry_failed_s=1.5,
        decode_timeout_s=9.0, max_jobs=3,
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('cache-size = "8MiB"', "unknown key 'cache-size' in .*; did you mean cache_size\\?"),
        ("worker = 2", "did you mean workers\\?"),
        ("lease = 2", "did you mean lease_s\\?"),
        ("colour = 'blue'", "unknown key 'colour'.*valid keys: listen, allow_remote"),
        ('[sources.a]\npth = "/d"', "unknown key 'pth' in \\[sources.a\\].*did you mean path\\?"),
        ('[sources.a]\npath = "/d"\nimagesize = 3', "did you mean image_size\\?"),
    ],
)
def test_unknown_toml_keys_name_the_closest_valid_key(tmp_path: Path, text: str, message: str) -> None:
    path = write_toml(tmp_path, text)
    with pytest.raises(InvalidArgumentError, match=message):
        load_config(["--config", path, "--source", f"a={tmp_path}"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('workers = "many"', "workers in .*: expected \"auto\" or a positive integer, got 'many'; write e.g. workers = \"auto\""),
        ("workers = true", "workers in .*positive integer, got True"),
        ("workers = 1.5", "workers in .*positive integer"),
        ("workers = -2", "workers in .*positive integer, got -2"),
        ('cache_size = "lots"', "cache_size in .*cannot read the size 'lots'.*2GiB"),
        ("cache_size = -5", "cache_size in .*positive size, got -5; write e.g. cache_size = \"2GiB\""),
        ("cache_size = 0", "cache_size in .*positive size"),
        ("cache_size = true", "cache_size in .*expected a size .* or \"auto\""),
        ('cache_size = "Auto"', "cache_size in .*cannot read the size 'Auto'.*or \"auto\" to size it from the data"),
        ("idle_exit_s = -1", "idle_exit_s in .*seconds >= 0, got -1; write e.g. idle_exit_s = 600"),
        ('idle_exit_s = "10m"', "idle_exit_s in .*seconds >= 0"),
        ('lease_s = "ten"', "lease_s in .*positive number of seconds, got 'ten'; write e.g. lease_s = 10"),
        ("lease_s = 0", "lease_s in .*positive number of seconds"),
        ("lease_s = nan", "lease_s in .*positive number of seconds"),
        ("lease_s = inf", "lease_s in .*positive number of seconds"),
        ("lookahead_batches = 0", "lookahead_batches in .*positive integer"),
        ("image_size = '256'", "image_size in .*positive integer"),
        ("seed = -1", "seed in .*integer >= 0"),
        ('log_level = "LOUD"', "log_level in .*one of DEBUG, INFO, WARNING, ERROR, got 'LOUD'"),
        ("log_level = 10", "log_level in .*one of DEBUG"),
        ('allow_remote = "yes"', "allow_remote in .*true or false"),
        ("retry_failed_s = -1", "retry_failed_s in .*seconds >= 0"),
        ("decode_timeout_s = 0", "decode_timeout_s in .*positive number of seconds"),
        ("max_jobs = 0", "max_jobs in .*positive integer"),
        ("ready_file = 5", "ready_file in .*non-empty string"),
        ("listen = 7070", "listen in .*non-empty string"),
        ('sources = "a"', "sources in .*tables \\[sources.NAME\\]"),
        ('[sources]\na = "/d"', "\\[sources.a\\] in .*a table with path"),
        ("[sources.a]\npath = 5", "path of \\[sources.a\\] in .*non-empty string"),
        ('[sources.a]\npath = "/d"\nimage_size = 0', "image_size of \\[sources.a\\] in .*positive integer"),
        ("workers = ", "cannot read config"),  # not TOML at all
    ],
)
def test_bad_toml_values_name_the_key_and_the_form(tmp_path: Path, text: str, message: str) -> None:
    path = write_toml(tmp_path, text)
    with pytest.raises(InvalidArgumentError, match=message):
        load_config(["--config", path, "--source", f"b={tmp_path}"])


def test_unreadable_config_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="cannot read config .*missing.toml"):
        load_config(["--config", str(tmp_path / "missing.toml"), "--source", f"a={tmp_path}"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "nothing to serve"),
        (["--source", "x"], "NAME=PATH"),
        (["--source", "x=/d", "--image-size", "y=10"], "no source named 'y'"),
        (["--source", "x=/d", "--image-size", "0"], "positive integer"),
        (["--source", "x=/d", "--image-size", "big"], "--image-size: expected a positive integer, got 'big'"),
        (["--source", "x=/d", "--workers", "0"], "--workers: expected \"auto\" or a positive integer, got 0; write e.g. --workers auto"),
        (["--source", "x=/d", "--lease-s", "0"], "positive"),
        (["--source", "x=/d", "--lease-s", "nan"], "--lease-s: expected a positive number of seconds"),
        (["--source", "x=/d", "--cache-size", "huge"], "--cache-size: cannot read the size"),
        (["--source", "x=/d", "--log-level", "LOUD"], "--log-level: expected one of DEBUG, INFO, WARNING, ERROR"),
        (["--source", "x=/d", "--max-jobs", "0"], "--max-jobs: expected a positive integer"),
        (["--source", "x=/d", "--decode-timeout-s", "0"], "--decode-timeout-s: expected a positive"),
        (["--source", "x=/d", "--retry-failed-s", "-1"], "--retry-failed-s: expected a number of seconds >= 0"),
        (["--source", "x=/d", "--idle-exit-s", "-5"], "--idle-exit-s: expected a number of seconds >= 0"),
        (["--source", "x=/d", "--idle-exit-s", "inf"], "--idle-exit-s: expected a number of seconds >= 0"),
        (["--source", "x=/d", "--seed", "-3"], "--seed: expected an integer >= 0"),
        (["--source", "x=/d", "--listen", "nonsense"], "the listen address: cannot parse address"),
    ],
)
def test_bad_settings_name_the_problem(argv: list[str], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        load_config(argv)


@pytest.mark.parametrize(
    "listen", ["0.0.0.0:7070", "[::]:7070", "192.168.1.20:7070", "10.0.0.1:0", "example.com:7070",
               "[fe80::1]:7070"],
)
def test_a_non_loopback_listen_needs_allow_remote(tmp_path: Path, listen: str) -> None:
    with pytest.raises(InvalidArgumentError, match="no authentication.*--allow-remote"):
        load_config(["--source", f"a={tmp_path}", "--listen", listen])
    assert load_config(["--source", f"a={tmp_path}", "--listen", listen, "--allow-remote"]).allow_remote
    path = write_toml(tmp_path, f'listen = "{listen}"\nallow_remote = true\n')
    assert load_config(["--config", path, "--source", f"a={tmp_path}"]).listen == listen


@pytest.mark.parametrize(
    "listen", ["127.0.0.1:0", "127.3.2.1:7070", "[::1]:7070", "localhost:7070", "unix:/tmp/x.sock",
               "/tmp/x.sock"],
)
def test_loopback_and_unix_listen_need_nothing(tmp_path: Path, listen: str) -> None:
    assert load_config(["--source", f"a={tmp_path}", "--listen", listen]).listen == listen


def test_a_remote_joader_address_is_refused_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOADER_ADDRESS", "0.0.0.0:7070")
    with pytest.raises(InvalidArgumentError, match="\\$JOADER_ADDRESS 0.0.0.0:7070.*--allow-remote"):
        load_config(["--source", f"a={tmp_path}"])


def test_addresses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert resolve_address("unix:///tmp/x.sock") == "unix:/tmp/x.sock"
    assert resolve_address("/tmp/x.sock") == "unix:/tmp/x.sock"
    assert resolve_address("127.0.0.1:7070") == "127.0.0.1:7070"
    assert socket_path("unix:/tmp/x.sock") == Path("/tmp/x.sock")
    assert socket_path("127.0.0.1:7070") is None
    monkeypatch.setenv("JOADER_ADDRESS", "127.0.0.1:9")
    assert resolve_address() == "127.0.0.1:9"
    monkeypatch.delenv("JOADER_ADDRESS")
    assert resolve_address().startswith("unix:") and resolve_address().endswith("joaderd.sock")
    with pytest.raises(InvalidArgumentError, match="HOST:PORT"):
        resolve_address("nonsense")


def test_num_workers_default_is_the_affinity_mask() -> None:
    assert config_module.default_num_workers() == len(os.sched_getaffinity(0))


def test_metrics_are_off_by_default_and_loopback_unless_allowed(tmp_path: Path) -> None:
    source = ["--source", f"a={tmp_path}", "--listen", "unix:/tmp/x.sock"]
    assert load_config(source).metrics_listen is None
    assert load_config([*source, "--metrics-listen", "127.0.0.1:9400"]).metrics_listen == "127.0.0.1:9400"
    with pytest.raises(InvalidArgumentError, match="other hosts.*--allow-remote"):
        load_config([*source, "--metrics-listen", "0.0.0.0:9400"])
    assert load_config([*source, "--metrics-listen", "0.0.0.0:9400", "--allow-remote"]).metrics_listen
    with pytest.raises(InvalidArgumentError, match="scrapes over TCP"):
        load_config([*source, "--metrics-listen", "unix:/tmp/m.sock"])
    path = write_toml(tmp_path, 'metrics_listen = "localhost:9400"\n')
    assert load_config(["--config", path, *source]).metrics_listen == "localhost:9400"


def test_workers_auto_is_the_default_and_adapts_up_to_the_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    source = ["--source", f"a={tmp_path}"]
    config = load_config(source)
    assert (config.autoscale, config.num_workers, config.max_workers) == (True, 2, 4)
    assert load_config([*source, "--workers", "auto"]) == config
    fixed = load_config([*source, "--workers", "3"])
    assert (fixed.autoscale, fixed.num_workers, fixed.max_workers) == (False, 3, 3)
    path = write_toml(tmp_path, 'workers = "auto"\n')
    assert load_config(["--config", path, *source]).autoscale


@pytest.mark.parametrize(("cpus", "fronts"), [(1, 0), (2, 0), (3, 0), (4, 1), (15, 1), (16, 2), (32, 3),
                                               (64, 4), (256, 4)])
def test_fronts_auto_none_below_four_cpus_then_one_per_sixteen(cpus: int, fronts: int) -> None:
    assert config_module.auto_fronts(cpus) == fronts


def test_fronts_from_flags_and_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda pid: set(range(32)))
    source = ["--source", f"a={tmp_path}"]
    assert load_config(source).num_fronts == 3  # auto, by the CPUs this process may use
    assert load_config([*source, "--fronts", "0"]).num_fronts == 0
    assert load_config([*source, "--fronts", "auto"]).num_fronts == 3
    path = write_toml(tmp_path, "fronts = 2\n")
    assert load_config(["--config", path, *source]).num_fronts == 2
    with pytest.raises(InvalidArgumentError, match=r"--fronts: expected \"auto\" or a count \(0: joaderd serves Next "
                       r"itself\), got -1; write e.g. --fronts auto"):
        load_config([*source, "--fronts", "-1"])
    with pytest.raises(InvalidArgumentError, match=r"fronts in .*got 'many'"):
        load_config(["--config", write_toml(tmp_path, 'fronts = "many"\n'), *source])


def test_idle_exit_from_flags_and_toml(tmp_path: Path) -> None:
    config = load_config(["--source", f"a={tmp_path}", "--idle-exit-s", "600"])
    assert config.idle_exit_s == 600.0
    path = write_toml(tmp_path, f'idle_exit_s = 30\n[sources.a]\npath = "{tmp_path}"\n')
    assert load_config(["--config", path]).idle_exit_s == 30.0
    assert load_config(["--config", path, "--idle-exit-s", "0"]).idle_exit_s == 0.0  # flags win


def test_a_plain_joaderd_never_exits_by_itself(tmp_path: Path) -> None:
    assert load_config(["--source", f"a={tmp_path}"]).idle_exit_s == 0.0


def test_cache_size_auto_from_the_flag_and_toml(tmp_path: Path) -> None:
    assert load_config(["--source", f"a={tmp_path}", "--cache-size", "auto"]).cache_size_bytes is None  # sized at start
    path = write_toml(tmp_path, f'cache_size = "auto"\n[sources.a]\npath = "{tmp_path}"\n')
    assert load_config(["--config", path]).cache_size_bytes is None
    assert load_config(["--config", path, "--cache-size", "64MiB"]).cache_size_bytes == 64 * 2**20  # flags win


def test_a_plain_joaderd_keeps_the_explicit_cache_size(tmp_path: Path) -> None:
    assert load_config(["--source", f"a={tmp_path}"]).cache_size_bytes == 2**30  # auto is opt-in
