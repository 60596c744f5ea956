"""A small S3 server of the tests' own on 127.0.0.1, honest or hostile.

Honest, it keeps objects in memory and answers the requests ckptfs sends
(path-style PUT, conditional PUT, GET with ranges, HEAD, DELETE,
ListObjectsV2 with pages, multipart uploads): enough for init, import, ls,
cat and gc. It checks no signature. Hostile, it answers some requests the
way a broken proxy or an attacker who can write to the bucket would:

  evil-id         ckptfs.json names repository_id "../../<target>"
  endless-config  the body of ckptfs.json never ends (chunked)
  endless-error   every GET fails with a 500 whose body never ends
  huge-length     ckptfs.json announces a 1 TiB Content-Length
  trickle-config  ckptfs.json arrives at 1 byte every 0.5 s
  repeat-token    every listing is truncated with the same token
  fresh-token     every listing is truncated with a token never sent
                  before, and every page holds the same keys (one made up
                  where the prefix holds none)
  empty-pages     every listing is truncated with a fresh token, and no
                  page holds a key
  endless-keys    every listing is truncated with a fresh token, and
                  every page holds keys never listed before
  outside-keys    listings return a key outside the prefix asked for
  evil-uploads    the multipart-upload listing holds keys that escape the
                  repository's prefix or cannot be written into a URL
  short-range     ranged GETs return fewer bytes than asked
  ignore-range    ranged GETs return the whole object with 200
  expiring        requests signed with the access key `expired_key` get
                  400 ExpiredToken, after `on_expired` (say, one that
                  writes fresh credentials into a file) has run

Every request is recorded as (method, path, query) in `requests`.
"""
import http.server
import threading
import time
import urllib.parse
from xml.sax.saxutils import escape

HOSTILE_MODES = ("evil-id", "endless-config", "endless-error", "huge-length", "trickle-config", "repeat-token",
                 "fresh-token", "empty-pages", "endless-keys", "outside-keys", "evil-uploads", "short-range", "ignore-range")
PAGE = 1000


class State:
    def __init__(self):
        self.lock = threading.Lock()
        self.buckets = set()
        self.objects = {}   # (bucket, key) -> bytes
        self.uploads = {}   # upload id -> (bucket, key, {part number: bytes})
        self.next_upload = 0
        self.mode = "honest"
        self.evil_id_target = ""
        self.expired_key = None
        self.on_expired = None
        self.access_keys = []  # the access key of each request, in order
        self.requests = []
        self.pages_sent = 0
        self.stop = threading.Event()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    @property
    def st(self):
        return self.server.state

    # ---- answers -------------------------------------------------------------------

    def answer(self, status, body=b"", headers=None, content_type="application/xml"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def error(self, status, code):
        self.answer(status, f"<?xml version=\"1.0\"?><Error><Code>{code}</Code></Error>".encode())

    def endless(self, status, limit=8 << 30):
        """A chunked body that goes on until the client hangs up (or 8 GiB)."""
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b"<Error>" + b"x" * (64 << 10)
        sent = 0
        try:
            while sent < limit and not self.st.stop.is_set():
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    # ---- parsing -------------------------------------------------------------------

    def parse(self):
        url = urllib.parse.urlsplit(self.path)
        parts = urllib.parse.unquote(url.path).lstrip("/").split("/", 1)
        bucket = parts[0]
        key = parts[1] if len(parts) > 1 else ""
        query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        auth = self.headers.get("Authorization", "")
        access_key = auth.split("Credential=", 1)[1].split("/", 1)[0] if "Credential=" in auth else ""
        with self.st.lock:
            self.st.requests.append((self.command, url.path, query))
            self.st.access_keys.append(access_key)
        return bucket, key, query

    def expired(self):
        """In mode expiring, answers ExpiredToken to the expired key."""
        st = self.st
        if st.mode != "expiring" or self.st.access_keys[-1] != st.expired_key:
            return False
        if st.on_expired:
            st.on_expired()
        if self.command == "PUT" or self.command == "POST":
            self.body()
        self.error(400, "ExpiredToken")
        return True

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    # ---- methods -------------------------------------------------------------------

    def do_PUT(self):
        bucket, key, q = self.parse()
        if self.expired():
            return
        data = self.body()
        st = self.st
        with st.lock:
            if not key:
                st.buckets.add(bucket)
                return self.answer(200)
            if bucket not in st.buckets:
                return self.error(404, "NoSuchBucket")
            if "uploadId" in q:
                up = st.uploads.get(q["uploadId"])
                if not up:
                    return self.error(404, "NoSuchUpload")
                up[2][int(q["partNumber"])] = data
                return self.answer(200, headers={"ETag": f"\"p{q['partNumber']}\""})
            if self.headers.get("If-None-Match") == "*" and (bucket, key) in st.objects:
                return self.error(412, "PreconditionFailed")
            st.objects[(bucket, key)] = data
        self.answer(200, headers={"ETag": "\"e\""})

    def do_POST(self):
        bucket, key, q = self.parse()
        if self.expired():
            return
        self.body()
        st = self.st
        with st.lock:
            if "uploads" in q:
                st.next_upload += 1
                uid = f"u{st.next_upload}"
                st.uploads[uid] = (bucket, key, {})
                return self.answer(200, f"<InitiateMultipartUploadResult><UploadId>{uid}</UploadId>"
                                        "</InitiateMultipartUploadResult>".encode())
            up = st.uploads.pop(q.get("uploadId", ""), None)
            if not up:
                return self.error(404, "NoSuchUpload")
            st.objects[(up[0], up[1])] = b"".join(up[2][n] for n in sorted(up[2]))
        self.answer(200, b"<CompleteMultipartUploadResult></CompleteMultipartUploadResult>")

    def do_DELETE(self):
        bucket, key, q = self.parse()
        if self.expired():
            return
        with self.st.lock:
            if "uploadId" in q:
                self.st.uploads.pop(q["uploadId"], None)
            else:
                self.st.objects.pop((bucket, key), None)
        self.answer(204)

    def do_HEAD(self):
        bucket, key, _ = self.parse()
        if self.expired():
            return
        with self.st.lock:
            data = self.st.objects.get((bucket, key))
        if data is None:
            return self.answer(404)
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()

    def do_GET(self):
        bucket, key, q = self.parse()
        if self.expired():
            return
        st = self.st
        mode = st.mode
        if mode == "endless-error":
            return self.endless(500)
        if not key:
            if bucket not in st.buckets:
                return self.error(404, "NoSuchBucket")
            return self.list_uploads(bucket, q) if "uploads" in q else self.list_objects(bucket, q)
        with st.lock:
            data = st.objects.get((bucket, key))
        if key.endswith("ckptfs.json") and data is not None:
            if mode == "evil-id":
                data = data.replace(b'"repository_id"', b'"repository_id": "../../' +
                                    st.evil_id_target.encode() + b'", "was"')
            elif mode == "endless-config":
                return self.endless(200)
            elif mode == "huge-length":
                self.send_response(200)
                self.send_header("Content-Length", str(1 << 40))
                self.end_headers()
                try:
                    while not st.stop.is_set():
                        self.wfile.write(b"{" * (64 << 10))
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True
                return
            elif mode == "trickle-config":
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    for b in data:
                        if st.stop.is_set():
                            break
                        self.wfile.write(bytes([b]))
                        self.wfile.flush()
                        time.sleep(0.5)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True
                return
        if data is None:
            return self.error(404, "NoSuchKey")
        rng = self.headers.get("Range")
        if rng and mode != "ignore-range":
            first, last = (int(x) for x in rng.split("=", 1)[1].split("-"))
            part = data[first:last + 1]
            if mode == "short-range" and len(part) > 1:
                part = part[:len(part) // 2]
            return self.answer(206, part, {"Content-Range": f"bytes {first}-{last}/{len(data)}"},
                               "application/octet-stream")
        self.answer(200, data, {"ETag": "\"e\""}, "application/octet-stream")

    def list_objects(self, bucket, q):
        st = self.st
        prefix = q.get("prefix", "")
        with st.lock:
            keys = sorted(k for (b, k) in st.objects if b == bucket and k.startswith(prefix))
        token_in = q.get("continuation-token") or ""
        start = int(token_in or 0) if st.mode not in ("repeat-token", "fresh-token", "empty-pages",
                                                      "endless-keys") else 0
        page = keys[start:start + PAGE]
        truncated = start + PAGE < len(keys)
        if st.mode == "repeat-token":
            truncated, token = True, "again"
        elif st.mode in ("fresh-token", "empty-pages"):
            with st.lock:
                st.pages_sent += 1
                truncated, token = True, f"fresh-{st.pages_sent}"
            if st.mode == "empty-pages":
                page = []
            elif not page:
                page = [prefix + "again"]
        elif st.mode == "endless-keys":
            with st.lock:
                st.pages_sent += 1
                n = st.pages_sent
            truncated, token = True, f"fresh-{n}"
            page = [f"{prefix}packs/{n:09d}-{i:04d}.pack" for i in range(PAGE)]
        else:
            token = str(start + PAGE)
        if st.mode == "outside-keys":
            page = page + ["somewhere-else/" + prefix.split("/")[-1] + "x"]
        xml = ["<?xml version=\"1.0\"?><ListBucketResult>"]
        xml += [f"<Contents><Key>{escape(k)}</Key></Contents>" for k in page]
        xml.append(f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>")
        if truncated:
            xml.append(f"<NextContinuationToken>{token}</NextContinuationToken>")
        xml.append("</ListBucketResult>")
        self.answer(200, "".join(xml).encode())

    def list_uploads(self, bucket, q):
        st = self.st
        prefix = q.get("prefix", "")
        with st.lock:
            ups = [(k, uid) for uid, (b, k, _) in st.uploads.items() if b == bucket and k.startswith(prefix)]
        if st.mode == "evil-uploads":
            ups += [(prefix + "../../victim-bucket/x", "evil1"), (prefix + "objects/packs/a key", "evil2"),
                    ("elsewhere/objects/packs/p", "evil3")]
        xml = ["<?xml version=\"1.0\"?><ListMultipartUploadsResult>"]
        xml += [f"<Upload><Key>{escape(k)}</Key><UploadId>{escape(u)}</UploadId></Upload>" for k, u in ups]
        xml.append("<IsTruncated>false</IsTruncated></ListMultipartUploadsResult>")
        self.answer(200, "".join(xml).encode())


class QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # clients that hang up on endless bodies are the point


class HostileS3:
    """Runs the server on a free loopback port until stop()."""

    def __init__(self):
        self.state = State()
        self.httpd = QuietServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.state = self.state
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.state.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
