"""Which joaderd `joader status`, `top` and `analyze` show with no `--address`: the decision,
pure (`which_server.choose`), and the order of the look-up (`find_address`, its probes faked).

Issue 38: a bare `joader status` while four `root=` jobs trained said "no joaderd is answering at
.../joaderd.sock ... pass root=PATH to JoaderDataset and it starts one itself": it looked only at
the default socket, and the user had to copy a 60-character socket path from `joader servers`.
"""

from __future__ import annotations

import pytest

from joader.client.tools import which_server
from joader.client.tools.which_server import AUTO, DEFAULT, ENV, Candidate, Looked, choose
from joader.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(30)

LOOKED = Looked("/run/user/1000/joader/joaderd.sock", "/run/user/1000/joader", "top", 600.0)
PHOTOS = Candidate("unix:/run/user/1000/joader/auto-photos-0123456789ab.sock", AUTO,
                   (("photos", "/data/photos"),), 4, 101)
CIFAR = Candidate("unix:/run/user/1000/joader/auto-cifar-ba9876543210.sock", AUTO, (("cifar", "/data/cifar"),), 0, 102)
HAND = Candidate("unix:/run/user/1000/joader/joaderd.sock", DEFAULT,
                 (("imagenet", "/data/in/train"), ("val", "/data/in/val")), 1, 100)


def test_the_one_auto_started_server_is_shown() -> None:
    assert choose([PHOTOS], source=None, looked=LOOKED) is PHOTOS


def test_the_one_server_at_the_default_socket_is_shown() -> None:
    assert choose([HAND], source=None, looked=LOOKED) is HAND


@pytest.mark.parametrize("candidates", [[PHOTOS, HAND], [HAND, PHOTOS, CIFAR]])
def test_several_are_listed_with_how_to_pick(candidates: list[Candidate]) -> None:
    with pytest.raises(InvalidArgumentError) as error:
        choose(candidates, source=None, looked=LOOKED)
    text = str(error.value)
    for candidate in candidates:
        assert candidate.address in text
        for name, root in candidate.sources:
            assert name in text and root in text
    assert "4 jobs attached" in text
    assert text.endswith("or --address ADDRESS")
    assert f"`joader top --source {candidates[0].sources[0][0]}`" in text


@pytest.mark.parametrize("source, expected", [("cifar", CIFAR), ("photos", PHOTOS), ("val", HAND)])
def test_source_picks_the_server_serving_it(source: str, expected: Candidate) -> None:
    assert choose([HAND, PHOTOS, CIFAR], source=source, looked=LOOKED) is expected


def test_an_unknown_source_lists_the_names_there_are() -> None:
    with pytest.raises(InvalidArgumentError, match="no joaderd of yours serves a source named 'photo'") as error:
        choose([PHOTOS, CIFAR], source="photo", looked=LOOKED)
    assert "photos" in str(error.value) and "cifar" in str(error.value)
    assert str(error.value).endswith("pass one of these names to --source, or --address ADDRESS")


def test_a_source_served_twice_asks_for_the_address() -> None:
    other = Candidate("unix:/run/user/1000/joader/auto-photos-ffffffffffff.sock", AUTO, (("photos", "/data/photos"),))
    with pytest.raises(InvalidArgumentError, match="2 joaderds of yours serve a source named 'photos'") as error:
        choose([PHOTOS, other], source="photos", looked=LOOKED)
    assert f"--address {PHOTOS.address}" in str(error.value)


def test_no_server_says_where_it_looked_and_that_a_root_server_exits_after_its_jobs() -> None:
    with pytest.raises(ConnectionError) as error:
        choose([], source=None, looked=LOOKED)
    text = str(error.value)
    assert LOOKED.default_socket in text and f"{LOOKED.runtime_dir}/auto-*.sock" in text
    assert "exits 10 minutes after its last job ends" in text
    assert "pass root=PATH to JoaderDataset and it starts one itself" not in text
    assert text.endswith("or pass --address ADDRESS")


# --- the order of the look-up ----------------------------------------------------------------


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """`find_address` with its gathering faked: records the env address it was given."""
    seen: list[str | None] = []

    def gather(env: str | None) -> list[Candidate]:
        seen.append(env)
        return [HAND, PHOTOS]

    monkeypatch.setattr(which_server, "_gather", gather)
    monkeypatch.delenv("JOADER_ADDRESS", raising=False)
    return seen


def test_an_explicit_address_is_used_without_looking(probes: list[str | None]) -> None:
    assert which_server.find_address("/tmp/x.sock", None) == "unix:/tmp/x.sock"
    assert probes == []


def test_joader_address_is_used_without_looking(probes: list[str | None], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOADER_ADDRESS", "unix:/tmp/env.sock")
    assert which_server.find_address(None, None) == "unix:/tmp/env.sock"
    assert probes == []


def test_source_looks_at_joader_address_too(probes: list[str | None], monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("JOADER_ADDRESS", "unix:/tmp/env.sock")
    assert which_server.find_address(None, "photos") == PHOTOS.address
    assert probes == ["unix:/tmp/env.sock"]
    assert "a job started for photos (/data/photos)" in capsys.readouterr().err


def test_candidate_lines_name_their_origin() -> None:
    assert ENV in Candidate("unix:/x.sock", ENV).line()


def test_the_only_server_with_jobs_is_shown_and_the_idle_ones_named() -> None:
    """A sweep's server stays up, idle, for 10 minutes after its last job: it does not make the
    user choose while another server's jobs train."""
    assert choose([PHOTOS, CIFAR], source=None, looked=LOOKED) is PHOTOS
    note = which_server.chosen_note(PHOTOS, [CIFAR])
    assert note == ("showing the joaderd a job started for photos (/data/photos); also running, with no job "
                    "attached: cifar (--source NAME shows one)")
    assert which_server.chosen_note(HAND, []) is None
