//! WebDriver over the minimal HTTP/1.1 client of `raw_http.rs`.

use super::*;

// ---- WebDriver over that client ----

/// chromedriver, killed on drop.
pub(super) struct Driver {
    pub(super) child: Child,
    pub(super) addr: SocketAddr,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Driver {
    pub(super) async fn start() -> Driver {
        for program in [CHROMIUM, CHROMEDRIVER] {
            assert!(
                Path::new(program).exists(),
                "{program} is missing: apt-get install chromium chromium-driver"
            );
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts (apt-get install chromium chromium-driver)");
        let driver = Driver {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if tokio::net::TcpStream::connect(driver.addr).await.is_ok() {
                let status = driver.call(Method::GET, "/status", None).await;
                if status["value"]["ready"] == true {
                    return driver;
                }
            }
            assert!(Instant::now() < deadline, "chromedriver did not get ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub(super) async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Value {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let reply = http(
            self.addr,
            method.clone(),
            path,
            &[("content-type", "application/json")],
            &body,
        )
        .await;
        let value: Value = serde_json::from_str(&reply.body)
            .unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {}", reply.body));
        assert!(
            reply.status == 200,
            "{method} {path} {body}: {} {}",
            reply.status,
            reply.body
        );
        value
    }

    pub(super) async fn session(&self) -> Session<'_> {
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1100,860"]
            }
        }}});
        let v = self.call(Method::POST, "/session", Some(caps)).await;
        let id = v["value"]["sessionId"]
            .as_str()
            .expect("a session id")
            .to_owned();
        Session { driver: self, id }
    }
}

pub(super) struct Session<'d> {
    pub(super) driver: &'d Driver,
    pub(super) id: String,
}

pub(super) const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

impl Session<'_> {
    pub(super) async fn cmd(&self, method: Method, path: &str, body: Option<Value>) -> Value {
        self.driver
            .call(method, &format!("/session/{}{path}", self.id), body)
            .await["value"]
            .clone()
    }
    pub(super) async fn go(&self, url: &str) {
        self.cmd(Method::POST, "/url", Some(json!({ "url": url })))
            .await;
    }
    pub(super) async fn find(&self, css: &str) -> String {
        // A click that submits a form returns before the next page loads.
        let until = Instant::now() + Duration::from_secs(15);
        while self.count(css).await == 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let v = self
            .cmd(
                Method::POST,
                "/element",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        v[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}: {v}"))
            .to_owned()
    }
    pub(super) async fn count(&self, css: &str) -> usize {
        let v = self
            .cmd(
                Method::POST,
                "/elements",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        v.as_array().map_or(0, Vec::len)
    }
    pub(super) async fn text(&self, css: &str) -> String {
        let e = self.find(css).await;
        self.cmd(Method::GET, &format!("/element/{e}/text"), None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
    pub(super) async fn click(&self, css: &str) {
        let e = self.find(css).await;
        self.cmd(
            Method::POST,
            &format!("/element/{e}/click"),
            Some(json!({})),
        )
        .await;
    }
    pub(super) async fn script(&self, script: &str) {
        self.cmd(
            Method::POST,
            "/execute/sync",
            Some(json!({"script": script, "args": []})),
        )
        .await;
    }
    /// Submits a form the page did not render: `fields` to `action`.
    pub(super) async fn post_form(&self, action: &str, fields: &[(&str, &str)]) {
        let fields = serde_json::to_string(fields).expect("json");
        self.script(&format!(
            "const f = document.createElement('form'); f.method = 'post'; f.action = {};\
             for (const [k, v] of {fields}) {{ const i = document.createElement('input');\
             i.type = 'hidden'; i.name = k; i.value = v; f.appendChild(i); }}\
             document.body.appendChild(f); f.submit();",
            serde_json::to_string(action).expect("json")
        ))
        .await;
        // The navigation the submit started.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    pub(super) async fn screenshot(&self) -> Vec<u8> {
        let v = self.cmd(Method::GET, "/screenshot", None).await;
        base64(v.as_str().expect("base64 png"))
    }
    pub(super) async fn quit(self) {
        self.driver
            .call(Method::DELETE, &format!("/session/{}", self.id), None)
            .await;
    }
}

/// Standard base64, padded.
pub(super) fn base64(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let bytes: Vec<u8> = s
        .bytes()
        .filter(|c| !c.is_ascii_whitespace() && *c != b'=')
        .collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            n |= u32::from(val(*c)) << (18 - 6 * i);
        }
        let [_, a, b, c] = n.to_be_bytes();
        out.push(a);
        if chunk.len() > 2 {
            out.push(b);
        }
        if chunk.len() > 3 {
            out.push(c);
        }
    }
    out
}
