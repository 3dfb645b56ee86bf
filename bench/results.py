"""What the Python benches share: writing a result file whole or not at all."""
import json
import os
import sys


def write_json(path, doc, who, indent=1):
    """Writes `doc` as JSON to `path`, in full beside it and then renamed over
    it, so that a failed write (a full disk) leaves an earlier file as it was
    and never a truncated one; exits with a line naming `who` and the path if
    it cannot. A symbolic link is written through (its target is renamed
    over), and a path that is not a regular file (/dev/stdout, a pipe) is
    written to directly."""
    path = os.path.realpath(path)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        if os.path.exists(path) and not os.path.isfile(path):
            with open(path, "w") as f:
                json.dump(doc, f, indent=indent)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=indent)
        os.replace(tmp, path)
    except OSError as e:
        sys.exit(f"{who}: cannot write {path}: {e.strerror or e}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
