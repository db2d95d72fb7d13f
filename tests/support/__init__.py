"""What the tests share, imported by them and never a test itself: the CLI runner (cli), serve and workers as
processes (service), one job spec builder (spec), the one-device reference (reference), the models the
service's processes import by name (models: tests.support.models:NAME), ports, network namespaces, and the
in-process harnesses (local, harness, lm, runs, records, deploy)."""
