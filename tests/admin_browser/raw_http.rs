//! A minimal HTTP/1.1 client over the hyper that axum already builds, one
//! connection per request: for the admin page's tests (`admin_browser`'s
//! WebDriver and raw requests, `admin_http`).

use std::net::SocketAddr;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;

/// What came back.
pub(crate) struct Reply {
    pub(crate) status: u16,
    /// The `Set-Cookie` header, if any.
    #[allow(dead_code)] // read by admin_http only
    pub(crate) set_cookie: Option<String>,
    pub(crate) body: String,
}

/// One request on a connection of its own; `Host` is the server's address.
pub(crate) async fn http(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(connection);
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_owned())))
        .expect("request");
    let response = sender.send_request(request).await.expect("a response");
    let status = response.status().as_u16();
    let set_cookie = response
        .headers()
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    Reply {
        status,
        set_cookie,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}
