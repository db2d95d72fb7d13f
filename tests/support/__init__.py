"""What the tests share, imported by them and never a test itself: the CLI runner (cli), serve and workers as
processes (service), the one job spec builder and its shared presets (spec), the one-device reference
(reference), the models the service's processes import by name (models: tests.support.models:NAME), ports and
network namespaces (ports, netns); for the in-process tests: stages and the driver in this process (local), the
supervisor with a fake clock (harness), causal LMs against one device (lm), BatchNorm's figures (batchnorm),
what crosses a cut (wire, structures), CUDA (cuda); for reading runs back: runs, records, deploy."""
