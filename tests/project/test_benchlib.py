"""bench.benchlib's ``--quick``: a quick run takes its sizes over the options' own, a full run keeps them."""
import argparse

from bench.benchlib import parse_quick


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    return parser


def test_quick_takes_its_sizes():
    args = parse_quick(_parser(), ["--quick", "--repeats", "9"], "small", repeats=2, lengths=[512])
    assert args.quick and args.repeats == 2 and args.lengths == [512]


def test_a_full_run_keeps_the_options():
    args = parse_quick(_parser(), ["--repeats", "9"], "small", repeats=2, lengths=[512])
    assert not args.quick and args.repeats == 9 and args.lengths == [4096]


def test_the_flag_says_what_a_quick_run_is():
    parser = _parser()
    parse_quick(parser, [], "seconds: two repeats", repeats=2)
    assert "--quick" in parser.format_help() and "seconds: two repeats" in parser.format_help()
