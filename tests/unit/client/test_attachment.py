"""`joader.client.attachment`: the default names of one process's jobs (NOTE [ Default names
that tell trials apart ] in placement.py) and joaderd's notice of a name another live job has
(NOTE [ Two live jobs of one name ] in server/registry/jobs.py), on a real joaderd."""

from __future__ import annotations

import logging
import os
import sys
import threading

import pytest

from joader.client import attachment, placement
from joader.client.dataset import JoaderDataset
from joader.client.tools.cli import fetch_status

pytestmark = pytest.mark.timeout(120)


def test_later_solo_names_of_a_base_are_numbered_also_across_threads() -> None:
    base = f"names-{os.getpid()}-{threading.get_ident()}"
    names: list[str] = []
    lock = threading.Lock()

    def take() -> None:
        for _ in range(50):
            name = attachment.next_solo_name(base)
            with lock:
                names.append(name)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(names) == sorted([base] + [f"{base}-{n}" for n in range(2, 201)])
    assert attachment.next_solo_name(f"{base}-other") == f"{base}-other"  # counted per base


def _names_by_id(address: str) -> dict[str, str]:
    return {job["job_id"]: job["name"] for job in fetch_status(address)["jobs"]}


def test_a_process_gives_its_later_datasets_numbered_default_names(joaderd: str) -> None:
    # Optuna's n_jobs: each trial's dataset built in its own thread of one process.
    datasets: list[JoaderDataset] = []
    lock = threading.Lock()

    def build() -> None:
        ds = JoaderDataset("demo", indices=range(8), address=joaderd, threads=None, batch_size=4)
        with lock:
            datasets.append(ds)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        base = placement.process_name()
        assert base == placement.command_name(sys.argv)  # pytest's command line
        shown = _names_by_id(joaderd)
        names = sorted(shown[ds.job_id] for ds in datasets)
        later = [name for name in names if name != base]
        assert len(set(names)) == 3 and len(later) >= 2, names  # earlier tests may have had the base
        assert all(name in {placement.numbered(base, n) for n in range(2, 100)} for name in later), names
        # attaching again as the same process (`settle`) keeps the dataset's name
        first = datasets[0]._attachment
        assert first.default_name(placement.Placement(0, 1, placement.ALONE)) == shown[datasets[0].job_id]
    finally:
        for ds in datasets:
            ds.close()


def test_a_name_another_live_job_has_is_served_and_logged_once_with_the_fix(
        joaderd: str, caplog: pytest.LogCaptureFixture) -> None:
    with JoaderDataset("demo", indices=range(8), address=joaderd, threads=None, batch_size=4, name="trial") as first:
        with caplog.at_level(logging.WARNING, logger="joader.client.dataset"):
            with JoaderDataset("demo", indices=range(4, 12), address=joaderd, threads=None, batch_size=4,
                               name="trial") as second:
                assert second.job_id != first.job_id
                shown = _names_by_id(joaderd)
                assert shown[first.job_id] == shown[second.job_id] == "trial"
                assert len(list(second)) == 8  # served all the same
        notices = [r.getMessage() for r in caplog.records if "already attached" in r.getMessage()]
        assert notices == [
            f"JoaderDataset('demo'), job {second.job_id}: a job named 'trial' is already attached (job id "
            f"{first.job_id}); this one ({second.job_id}) is served as a separate job under the same name. "
            "Pass each JoaderDataset its own name= to tell them apart in joader status"]
        # the first one attached alone: it was told nothing
        assert not first._attachment.noticed and second._attachment.noticed


def test_a_job_that_expects_another_decoding_is_told_the_flag() -> None:
    """Without root=, decoder=, upscale= and exif_transpose= are what the job expects, checked
    against the stage's name as image_size= is (NOTE [ Declaring the stage in the client ])."""
    from joader.stages.image import DEFAULT_DECODER

    assert DEFAULT_DECODER != "pil"
    expected = attachment.Expected.make("photos", image_size=None, mode=None, stage=None, decoder="pil",
                                        upscale=False, exif_transpose=True)
    where = "joaderd at unix:/s serves source 'photos' with stage"
    assert expected.mismatches("center-crop:64/pil/no-upscale/exif-transpose", 64, "unix:/s") == []
    found = expected.mismatches("center-crop:64", 64, "unix:/s")
    assert found == [
        f"{where} 'center-crop:64': decoder {DEFAULT_DECODER!r}, and this job expects decoder='pil'. Start joaderd "
        f"with --decoder pil, or pass decoder={DEFAULT_DECODER!r} (or pass root= and joader starts a server with "
        "these options)",
        f"{where} 'center-crop:64': images smaller than S upscaled, and this job expects upscale=False. Start "
        "joaderd with --no-upscale photos, or pass upscale=True (or pass root= and joader starts a server with "
        "these options)",
        f"{where} 'center-crop:64': EXIF orientation not applied, and this job expects exif_transpose=True. "
        "Start joaderd with --exif-transpose photos, or pass exif_transpose=False (or pass root= and joader "
        "starts a server with these options)"]
    assert expected.mismatches("max-side:64/pil/exif-transpose", 64, "unix:/s") == []  # max-side never upscales
    assert attachment.Expected.make("photos", image_size=None, mode=None, stage=None).mismatches(
        "center-crop:64/pil-draft/no-upscale", 64, "unix:/s") == []  # nothing declared: anything goes
