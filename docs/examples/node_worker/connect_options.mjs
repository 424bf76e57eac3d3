// nats.js options for a Tandem NATS URL. nats.js reads only host and port from `servers`: it drops
// the user, password or token of `nats://user:pass@host:4222` and the `tls://` scheme, so a worker
// that passes TANDEM_NATS_URL as it is gets "Authorization Violation". They become options here.
//
//   nats://user:pass@host:4222     → { servers: ["host:4222"], user, pass }   (both percent-decoded)
//   nats://TOKEN@host:4222         → { servers: ["host:4222"], token }        (a user without a password)
//   tls://user:pass@host:4222      → ... plus tls: {}; with TANDEM_NATS_CA: tls: { caFile }
//   nats://a:1,nats://b:2          → servers: ["a:1", "b:2"] (a cluster; the first login found is used)
import { isIP } from "node:net";
import { checkServerIdentity } from "node:tls";

export function connectOptions(urls, caFile = process.env.TANDEM_NATS_CA) {
  const options = { servers: [] };
  const ips = [];
  let tls = Boolean(caFile);
  for (const raw of urls.split(",").map((u) => u.trim()).filter(Boolean)) {
    const url = new URL(raw.includes("://") ? raw : `nats://${raw}`);
    tls ||= url.protocol === "tls:";
    options.servers.push(url.port ? `${url.hostname}:${url.port}` : url.hostname);
    const bare = url.hostname.replace(/^\[(.*)\]$/, "$1");
    if (isIP(bare)) ips.push(bare);
    if (url.username && !("user" in options || "token" in options)) {
      if (url.password) {
        options.user = decodeURIComponent(url.username);
        options.pass = decodeURIComponent(url.password);
      } else {
        options.token = decodeURIComponent(url.username);
      }
    }
  }
  if (tls) {
    options.tls = caFile ? { caFile } : {};  // {}: the system's CAs
    // nats.js names no TLS server for an IP address, and Node then checks the certificate against
    // "localhost": check it against the URL's addresses instead (tandem up's certificates name them)
    if (ips.length) options.tls.checkServerIdentity = (host, cert) =>
      [host, ...ips].some((name) => checkServerIdentity(name, cert) === undefined) ? undefined
        : checkServerIdentity(ips[0], cert);
  }
  return options;
}
