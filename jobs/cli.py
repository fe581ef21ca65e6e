def main() -> None:
    raise SystemExit("specprefill CLI: not yet built")
