"""Put first on PYTHONPATH by tests/integration/test_resume.py: every process of the run (launch.py
and the ranks it spawns) appends each training-stream fetch to $GTP_SAMPLE_TRACE, one JSON line
of the stream indices, so a test sees which samples were really trained, from outside the
trainer's own accounting."""
import json
import os

if os.environ.get("GTP_SAMPLE_TRACE"):
    from trainer.data import stream

    _get = stream.SampleStream.get

    def _traced(self, indices):
        if self.split == "train":
            line = json.dumps([int(i) for i in indices]) + "\n"
            fd = os.open(os.environ["GTP_SAMPLE_TRACE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                os.write(fd, line.encode())  # one write: ranks appending at once never interleave
            finally:
                os.close(fd)
        return _get(self, indices)

    stream.SampleStream.get = _traced
