"""`python -m worker`: a job attempt's worker process (see gpipe.worker.attempt).

Started ahead of its attempt by its agent (gpipe.worker.agent), it imports
torch and what building a stage needs, then waits for one line of JSON on
stdin saying which attempt to join: {"rank", "world", "master", "host",
"start_timeout_s", "log", "secret", "code_dir"} (code_dir: the job's folder, under serve this
worker's copy of the job's code: the stage imports from it and runs in it, its working directory; "": none
given). So a join costs no import time. Under `run`, its environment names the job's model (WARM_ENV), which it
builds ahead, on the meta device, while the coordinator plans (gpipe.stage.warm). With arguments, it joins at once
(`python -m worker --rank N --world W --master H:P --host H`).
"""

import json
import os
import sys

from gpipe import proc

proc.adopt()  # first, before the seconds torch takes to import: die with the parent from the start

import torch._dynamo  # noqa: E402, F401 - building an optimizer imports it (1.5 s on a CPU build)

from gpipe.worker.agent import WARM_ENV  # noqa: E402
from gpipe.worker.attempt import main  # noqa: E402

if len(sys.argv) > 1:
    proc.exit_now(main())
said = None  # what building the model ahead said (its warnings), for the stage's log
if warm := os.environ.pop(WARM_ENV, ""):  # `run`'s: the model built while the coordinator plans
    import tempfile

    from gpipe.stage import warm as build_ahead

    said = tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    kept = os.dup(1), os.dup(2)
    os.dup2(said.fileno(), 1)
    os.dup2(said.fileno(), 2)
    try:
        build_ahead(**json.loads(warm))
    except BaseException:  # noqa: S110 - a factory that exits or raises: the stage's own build meets it, logged
        pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for k, fd in enumerate(kept, 1):
            os.dup2(fd, k)
            os.close(fd)
line = sys.stdin.readline()
if not line:  # the agent went away before a join
    proc.exit_now(0)
j = json.loads(line)
fd = os.open(j["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # an absolute path: the agent's
os.dup2(fd, 1)
os.dup2(fd, 2)
os.close(fd)
if said is not None:
    said.seek(0)
    while chunk := said.read(1 << 16):
        os.write(2, chunk)
    said.close()
if j.get("code_dir"):
    from gpipe.errors import EXIT_BAD_INPUT, GpipeError
    from gpipe.factory import use_job_code

    try:
        use_job_code(j["code_dir"])  # its modules, and its folder as the working directory
    except GpipeError as e:  # the folder is gone: one line in the stage's log, the input's exit code
        print(f"error: {e}", file=sys.stderr, flush=True)
        proc.exit_now(EXIT_BAD_INPUT)
proc.exit_now(main(["--rank", str(j["rank"]), "--world", str(j["world"]), "--master", j["master"],
                    "--host", j["host"], "--start-timeout", str(j["start_timeout_s"])], secret=j["secret"]))
