"""What the Python benches share: writing a result file whole or not at all."""
import json
import os
import sys


def write_json(path, doc, who, indent=1):
    """Writes `doc` as JSON to `path`, in full beside it and then renamed over
    it, so that a failed write (a full disk) leaves an earlier file as it was
    and never a truncated one; exits with a line naming `who` and the path if
    it cannot. A symbolic link is written through (its target is renamed
    over), and a stream's path (/dev/stdout, /dev/fd/N, under /proc:
    whatever the stream is) or one that is not a regular file (a FIFO) is
    written to directly, appending."""
    given = path
    tmp = None
    try:
        # Asked of the path as given: /dev/stdout resolves to a pipe's
        # "pipe:[…]", which is no file at all, or to the file a shell
        # redirected the stream to, which a rename would replace.
        special = given.startswith(("/dev/std", "/dev/fd/", "/proc/"))
        if special or (os.path.exists(given) and not os.path.isfile(given)):
            with open(given, "a") as f:
                json.dump(doc, f, indent=indent)
            return
        path = os.path.realpath(given)
        tmp = f"{path}.{os.getpid()}.tmp"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=indent)
        os.replace(tmp, path)
    except OSError as e:
        sys.exit(f"{who}: cannot write {given}: {e.strerror or e}")
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
