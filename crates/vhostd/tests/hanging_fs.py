#!/usr/bin/env python3
"""A FUSE file system holding one file, /disk, of SIZE bytes (zeros, kept
in memory), whose reads and writes wait while the file HOLD exists: a disk
that hangs, as an NFS mount does when its server goes away. Mounted with
direct_io, so every read and write reaches it (no page cache).

usage: hanging_fs.py MOUNTPOINT SIZE HOLD   (runs in the foreground)
"""
import errno
import os
import stat
import sys
import time

# Debian names the module fusepy (python3-fusepy); upstream, fuse.
try:
    from fusepy import FUSE, FuseOSError, Operations
except ImportError:
    from fuse import FUSE, FuseOSError, Operations


class Hanging(Operations):
    def __init__(self, size, hold):
        self.data = bytearray(size)
        self.hold = hold

    def _wait(self):
        while os.path.exists(self.hold):
            time.sleep(0.01)

    def getattr(self, path, fh=None):
        now = time.time()
        if path == "/":
            return dict(st_mode=stat.S_IFDIR | 0o755, st_nlink=2, st_atime=now, st_mtime=now, st_ctime=now)
        if path == "/disk":
            return dict(st_mode=stat.S_IFREG | 0o644, st_nlink=1, st_size=len(self.data),
                        st_atime=now, st_mtime=now, st_ctime=now)
        raise FuseOSError(errno.ENOENT)

    def readdir(self, path, fh):
        return [".", "..", "disk"]

    def open(self, path, flags):
        if path != "/disk":
            raise FuseOSError(errno.ENOENT)
        return 0

    def read(self, path, size, offset, fh):
        self._wait()
        return bytes(self.data[offset:offset + size])

    def write(self, path, buf, offset, fh):
        self._wait()
        end = min(offset + len(buf), len(self.data))
        self.data[offset:end] = buf[:end - offset]
        return len(buf)

    def truncate(self, path, length, fh=None):
        return 0

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        self._wait()
        return 0


if __name__ == "__main__":
    mnt, size, hold = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    FUSE(Hanging(size, hold), mnt, foreground=True, direct_io=True)
