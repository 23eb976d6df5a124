//! Hosts of our own for tests of what crosses a network: each process in a network namespace
//! the test makes, with its own address on a bridge in a hub namespace, and a veth from the
//! test's namespace to the hub so the test itself reaches every host. Partitions are iptables
//! rules inside the hosts' namespaces (drop by source or destination address: symmetric,
//! one-way, bridge), loss and delay `tc netem` on a host's interface. Nothing is added to the
//! test's namespace but that one veth (with a private /24), and dropping the `Net` removes
//! every namespace, link and rule it made. Needs root (CI runs as root).

use std::process::Command;

use anyhow::{Context, Result, bail};

/// A private /24 of our own hosts: `.1..=.n` are hosts, `.254` the test's end.
pub struct Net {
    tag: String,
    subnet: String,
    hosts: usize,
}

fn run(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("run {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Net {
    /// `hosts` namespaces on one bridge. Err when namespaces cannot be made (not root).
    pub fn new(hosts: usize) -> Result<Self> {
        use rand::Rng;
        let mut rng = rand::rng();
        let tag = format!("rc{:05x}", rng.random_range(0..0xfffff));
        let subnet = format!(
            "10.{}.{}",
            rng.random_range(160..250),
            rng.random_range(1..250)
        );
        let net = Self {
            tag,
            subnet,
            hosts: 0,
        };
        let hub = net.hub();
        run(&["ip", "netns", "add", &hub])?;
        run(&["ip", "-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        run(&["ip", "-n", &hub, "link", "set", "br0", "up"])?;
        // The test's own end: created here, its peer moved into the hub.
        let mine = format!("{}t", net.tag);
        let theirs = format!("{}T", net.tag);
        run(&[
            "ip", "link", "add", &mine, "type", "veth", "peer", "name", &theirs, "netns", &hub,
        ])?;
        run(&[
            "ip", "-n", &hub, "link", "set", &theirs, "master", "br0", "up",
        ])?;
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{}.254/24", net.subnet),
            "dev",
            &mine,
        ])?;
        run(&["ip", "link", "set", &mine, "up"])?;
        let mut net = net;
        for i in 0..hosts {
            let ns = net.ns(i);
            run(&["ip", "netns", "add", &ns])?;
            net.hosts += 1;
            let port = format!("{}p{i}", net.tag);
            run(&[
                "ip", "-n", &hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0",
                "netns", &ns,
            ])?;
            run(&[
                "ip", "-n", &hub, "link", "set", &port, "master", "br0", "up",
            ])?;
            run(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", net.addr(i)),
                "dev",
                "eth0",
            ])?;
            run(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            run(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    fn hub(&self) -> String {
        format!("{}h", self.tag)
    }

    /// Namespace of host `i`.
    pub fn ns(&self, i: usize) -> String {
        format!("{}n{i}", self.tag)
    }

    /// Address of host `i`.
    pub fn addr(&self, i: usize) -> String {
        format!("{}.{}", self.subnet, i + 1)
    }

    /// Runs `command` (words separated by spaces) inside host `i`'s namespace.
    fn on(&self, i: usize, command: &str) -> Result<()> {
        let ns = self.ns(i);
        let mut args = vec!["ip", "netns", "exec", &ns];
        args.extend(command.split_whitespace());
        run(&args)
    }

    /// Host `i` drops what comes from host `from` (one way: `from` still hears `i`).
    pub fn drop_from(&self, i: usize, from: usize) -> Result<()> {
        self.on(
            i,
            &format!("iptables -A INPUT -s {} -j DROP", self.addr(from)),
        )
    }

    /// Hosts `a` and `b` no longer hear each other.
    pub fn cut(&self, a: usize, b: usize) -> Result<()> {
        self.drop_from(a, b)?;
        self.drop_from(b, a)
    }

    /// Host `i` drops each packet it receives with probability `p` (iptables `statistic`).
    pub fn lossy(&self, i: usize, p: f64) -> Result<()> {
        self.on(
            i,
            &format!("iptables -A INPUT -m statistic --mode random --probability {p} -j DROP"),
        )
    }

    /// Loss and delay on host `i`'s interface (`tc netem`), e.g. "delay 40ms 10ms loss 5%".
    /// Err where the kernel has no netem (`sch_netem` not built or loaded).
    pub fn netem(&self, i: usize, spec: &str) -> Result<()> {
        self.on(i, &format!("tc qdisc replace dev eth0 root netem {spec}"))
    }

    /// Every rule and qdisc removed: all hosts hear each other again.
    pub fn heal(&self) -> Result<()> {
        for i in 0..self.hosts {
            self.on(i, "iptables -F INPUT")?;
            // No netem qdisc is not an error worth reporting.
            let _ = self.on(i, "tc qdisc del dev eth0 root");
        }
        Ok(())
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for i in 0..self.hosts {
            let _ = run(&["ip", "netns", "del", &self.ns(i)]);
        }
        // Deleting the hub removes the bridge, its ports and the peer of the test's veth,
        // which takes the test's end with it.
        let _ = run(&["ip", "netns", "del", &self.hub()]);
        let _ = run(&["ip", "link", "del", &format!("{}t", self.tag)]);
    }
}
