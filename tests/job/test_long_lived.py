"""A job's long-lived objects are out of the garbage collector's view while it runs."""

from __future__ import annotations

import gc

from temper.job.long_lived import long_lived_objects_frozen


def test_a_jobs_long_lived_objects_are_frozen_only_while_it_runs():
    gc.unfreeze()  # whatever an earlier test in this process left frozen
    assert gc.get_freeze_count() == 0
    with long_lived_objects_frozen():
        assert gc.get_freeze_count() > 0  # what was alive on entry: out of the collector's view
    assert gc.get_freeze_count() == 0  # handed back: a later collection can free it


def test_a_process_that_froze_its_objects_keeps_them_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with long_lived_objects_frozen():
            pass
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()


def test_the_objects_are_handed_back_when_the_job_fails():
    try:
        with long_lived_objects_frozen():
            raise RuntimeError("a step failed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0
