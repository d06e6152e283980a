"""Byte counting can be switched off: collectives then record nothing, and tensor-parallel steps
run without the counting dispatch mode."""

import contextlib

from fp8lm.distributed import accounting, comm


def test_counting_off_records_nothing_and_skips_the_dispatch_mode():
    accounting.reset_comm_stats()
    previous = accounting.set_counting(False)
    try:
        accounting.record("all_reduce", 1024, 4, 1024)
        assert accounting.comm_stats()["total_bytes"] == 0 and accounting.comm_stats()["all_reduce_calls"] == 0
        assert isinstance(comm.counted_functional_collectives(), contextlib.nullcontext)
    finally:
        accounting.set_counting(previous)
    assert accounting.counting() is previous is True
    accounting.record("all_reduce", 1024, 4, 1024)
    assert accounting.comm_stats()["all_reduce_bytes"] == 2 * 3 / 4 * 1024
    assert isinstance(comm.counted_functional_collectives(), comm.CountedFunctionalCollectives)
    accounting.reset_comm_stats()
