"""atomic_write: how the tools write a token or mask file (plain Python, no dependencies)."""
import os
import sys


def write_atomically(path, parts):
    """Write the byte strings parts to path so that it appears whole or not at all: a
    full disk or an interruption leaves the old file, if any, and no half-written one
    under its name. A path that is a link, a device or a FIFO (/dev/stdout, a pipe to a
    compressor) is written through, not replaced. An OSError names path."""
    direct = os.path.islink(path) or (os.path.exists(path) and not os.path.isfile(path))
    tmp = path if direct else "%s.tmp-%d" % (path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            for b in parts:
                f.write(b)
        if not direct:
            os.replace(tmp, path)
    except BaseException as e:
        if not direct and os.path.lexists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):  # named by the output, not its temporary name
            raise OSError(e.errno, e.strerror, path) from e
        raise


def interruptible(name, main):
    """main() of the tool name, an interrupt (Ctrl-C, SIGINT) said in one line, exit 130,
    not a traceback: the writers above leave no file half-written."""
    try:
        main()
    except KeyboardInterrupt:
        print("%s: interrupted: no output written" % name, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)  # not sys.exit: exit handlers (a process pool's) may wait on what the interrupt cut
