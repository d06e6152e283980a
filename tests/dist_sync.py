"""Worker for the collective and FP8DataParallel tests: both sets of checks in one launch (each
launch pays the ranks' start-up), results keyed by test module."""

from dist_collectives import checks as collective_checks
from dist_data_parallel import checks as data_parallel_checks
from dist_launch import worker_main


def checks(rank, world):
    return {"collectives": collective_checks(rank, world), "data_parallel": data_parallel_checks(rank, world)}


if __name__ == "__main__":
    worker_main(checks)
