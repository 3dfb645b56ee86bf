"""What the Python benches share: writing a result file whole or not at all."""
import json
import os
import sys


def write_json(path, doc, who, indent=1):
    """Writes `doc` as JSON to `path`, in full beside it and then renamed over
    it, so that a failed write (a full disk) leaves an earlier file as it was
    and never a truncated one; exits with a line naming `who` and the path if
    it cannot."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=indent)
        os.replace(tmp, path)
    except OSError as e:
        sys.exit(f"{who}: cannot write {path}: {e.strerror or e}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
