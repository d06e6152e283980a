"""Running the `fp8lm` command in-process for tests."""

from fp8lm.cli import main


def run_main(argv, capsys):
    """``(exit code, stdout, stderr)`` of ``fp8lm ARGV``; argparse refusals give their exit code."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err
