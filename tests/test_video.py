"""Writing a video leaves this process's scheduling as it was.

SVT-AV1, run as root (a container, CI), switches the thread that opens an encoder to SCHED_FIFO at
priority 99; every thread and subprocess started afterwards inherits it, and a spin-waiting one
then never yields its core (the two jax.distributed processes after a Meta-World collection in the
same pytest worker stalled for good). Each case runs in a subprocess of its own, so that a failure
cannot leave this worker real-time.
"""

import os
import subprocess
import sys

import pytest

av = pytest.importorskip("av")

# Encode five frames (through zerojax's writer, or PyAV's own encoder as the control), then print
# the scheduling policy of this thread, of a thread started afterwards and of a child process.
SCRIPT = """
import os, subprocess, sys, threading
import numpy as np
frames = [np.full((64, 64, 3), 40 * i, np.uint8) for i in range(5)]
if sys.argv[1] == "zerojax":
    from zerojax.sim import video
    video.write(sys.argv[2], frames, 10)
elif sys.argv[1] == "block":
    from zerojax.sim import video
    with video.no_realtime_scheduling():
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        threading.Thread(target=lambda: None).start()
else:
    import av
    with av.open(sys.argv[2], "w") as out:
        stream = out.add_stream("libsvtav1", 10)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
seen = []
threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0))).start()
child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"], capture_output=True, text=True)
print(os.sched_getscheduler(0), seen[0], int(child.stdout))
"""

needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="SVT-AV1 and sched_setscheduler raise a thread to real time only as root")
needs_svt = pytest.mark.skipif("libsvtav1" not in av.codecs_available, reason="this PyAV has no SVT-AV1 encoder")


def policies(how, tmp_path):
    env = {**os.environ, "SVT_LOG": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, how, str(tmp_path / f"{how}.mp4")], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return [int(p) for p in done.stdout.split()]


@needs_root
@needs_svt
def test_svt_av1_alone_leaves_the_process_real_time(tmp_path):
    """The control: what the writer guards against happens here."""
    assert policies("pyav", tmp_path) == [os.SCHED_FIFO] * 3


@needs_root
@needs_svt
def test_zerojax_writer_leaves_threads_and_children_as_they_were(tmp_path):
    assert policies("zerojax", tmp_path) == [os.SCHED_OTHER] * 3


@needs_root
def test_the_block_puts_back_what_was_raised_inside_it(tmp_path):
    assert policies("block", tmp_path) == [os.SCHED_OTHER] * 3
