"""`--enable-ssl-refresh`: the server's certificate, key and client authority re-read when their
files change, as vLLM's flag does, so a certificate rotated on disk (cert-manager, certbot)
serves without a restart. New connections get the new certificate; open ones keep theirs.

The files are polled. A change that does not load (a key that does not match the certificate
yet, halfway through a rotation that writes one file then the other) leaves the old ones serving
and is tried again on the next poll until it loads; a new authority's certificates are added to
those clients may show.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl

from server.settings import TlsFiles

logger = logging.getLogger(__name__)

# Seconds between looks at the files.
POLL_SECONDS = 1.0

Stamp = tuple[tuple[int, int, int] | None, ...]


class CertificateWatcher:
    """Re-reads `tls`'s files into `context` (the one the server handshakes with) when they
    change."""

    def __init__(self, context: ssl.SSLContext, tls: TlsFiles, interval: float = POLL_SECONDS):
        self.context = context
        self.tls = tls
        self.interval = interval
        self.loaded = self._stamp()
        self.reloads = 0

    def _paths(self) -> list[str]:
        return [self.tls.certfile, self.tls.keyfile, *filter(None, [self.tls.ca_certs])]

    def _stamp(self) -> Stamp:
        stamps: list[tuple[int, int, int] | None] = []
        for path in self._paths():
            try:
                found = os.stat(path)
            except OSError:
                stamps.append(None)
                continue
            stamps.append((found.st_mtime_ns, found.st_size, found.st_ino))
        return tuple(stamps)

    def check(self) -> bool:
        """Load the files if they changed since they last loaded; whether they were."""
        stamp = self._stamp()
        if stamp == self.loaded:
            return False
        try:
            # Tried on a scratch context first: a failed load would leave the serving one
            # holding a certificate without its key.
            for context in (ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), self.context):
                context.load_cert_chain(self.tls.certfile, self.tls.keyfile)
                if self.tls.ca_certs is not None:
                    context.load_verify_locations(self.tls.ca_certs)
        except (OSError, ssl.SSLError) as exc:
            logger.warning("the TLS files changed but do not load (%s); the old ones serve", exc)
            return False
        self.loaded = stamp
        self.reloads += 1
        logger.info("TLS certificate reloaded from %s", self.tls.certfile)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.check()
