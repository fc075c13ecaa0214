//! A bare HTTP/1.1 client: one connection per request, the reply as bytes
//! (the cache check compares them byte for byte).

use std::net::SocketAddr;

use axum::http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub replayed: bool,
    pub etag: Option<String>,
    pub body: Bytes,
}

#[derive(Debug, Clone, Copy)]
pub struct Client {
    pub addr: SocketAddr,
}

impl Client {
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, String)],
        body: Option<serde_json::Value>,
    ) -> Reply {
        let stream = tokio::net::TcpStream::connect(self.addr)
            .await
            .expect("connect to the service");
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("HTTP handshake");
        tokio::spawn(connection);
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", self.addr.to_string());
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        let bytes = match body {
            Some(body) => {
                request = request.header("content-type", "application/json");
                Bytes::from(body.to_string())
            }
            None => Bytes::new(),
        };
        let response = sender
            .send_request(request.body(Full::new(bytes)).expect("a request"))
            .await
            .expect("a response");
        let status = response.status().as_u16();
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let replayed = header("idempotent-replayed").as_deref() == Some("true");
        let etag = header("etag");
        let body = response
            .into_body()
            .collect()
            .await
            .expect("the body")
            .to_bytes();
        Reply {
            status,
            replayed,
            etag,
            body,
        }
    }
}
