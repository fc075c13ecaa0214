//! Which server session an `AsyncPgConnection` talks to, found without
//! sending it anything.
//!
//! A body gets `&mut AsyncPgConnection` and can swap the connection behind
//! it for one it opened itself (`std::mem::replace`). idem's `COMMIT` would
//! then go to that one: it would commit whatever the body began there,
//! without idem's record, while idem's own transaction stayed open on a
//! connection the body holds. The session's key tells them apart: the
//! server gives each connection a process id and a secret at start-up,
//! idem's wire reads them as they arrive ([`super::wire::Wire::backend_key`]),
//! and the connection keeps them in its cancel token. tokio-postgres does
//! not show a token's fields, but writes them out in a cancel request to a
//! stream of the caller's choosing: here, a buffer in memory, behind the
//! same pass-through "TLS" as the connection's own (its token asks for
//! direct TLS, see [`super::wire`]).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use diesel_async::AsyncPgConnection;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, TlsConnect, TlsStream};

/// A cancel request: its length, the cancel code, the process id, the secret.
const CANCEL_REQUEST: usize = 16;

/// The process id and the secret the server gave `conn` at start-up, as
/// its cancel token holds them.
///
/// Nothing goes to the server. `None` if tokio-postgres wrote something
/// other than a bare cancel request (a connection of the application's that
/// negotiates TLS the usual way writes an `SSLRequest` first, and reads
/// nothing back here): not one of idem's.
///
/// Not async: everything the request is written through is ready at once,
/// so one poll finishes it. Awaited, its future (tokio-postgres's cancel
/// request, about 0.5 KB) would sit inline in every checkout's and every
/// commit's, and be copied with them.
pub(super) fn backend_key(conn: &AsyncPgConnection) -> Option<[u8; 8]> {
    let mut request = Vec::with_capacity(CANCEL_REQUEST);
    let token = conn.cancel_token();
    {
        let written = std::pin::pin!(token.cancel_query_raw(Written(&mut request), Through));
        match written.poll(&mut Context::from_waker(std::task::Waker::noop())) {
            Poll::Ready(Ok(())) => {}
            // A version of tokio-postgres that waited on something here
            // would make every connection read as "not one of idem's": every
            // call would fail with ConnectionReplaced, as the suite's first
            // idempotent call would show.
            Poll::Ready(Err(_)) | Poll::Pending => return None,
        }
    }
    (request.len() == CANCEL_REQUEST)
        .then(|| <[u8; 8]>::try_from(&request[8..]).ok())
        .flatten()
}

/// A stream that keeps what is written to it and has nothing to read.
struct Written<'a>(&'a mut Vec<u8>);

/// The "TLS" of idem's connections, over [`Written`]: the stream itself.
struct Through;

impl<'a> TlsConnect<Written<'a>> for Through {
    type Stream = Written<'a>;
    type Error = io::Error;
    type Future = std::future::Ready<io::Result<Written<'a>>>;

    fn connect(self, stream: Written<'a>) -> Self::Future {
        std::future::ready(Ok(stream))
    }
}

impl TlsStream for Written<'_> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl AsyncRead for Written<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        _: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Written<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        bytes: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().0.extend_from_slice(bytes);
        Poll::Ready(Ok(bytes.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
