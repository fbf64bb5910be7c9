//! The man page, generated from the command line definition (clap_mangen):
//! `vhostd man > doc/vhostd.1`. A test keeps the committed page current.

use clap::CommandFactory;

/// vhostd(1) in roff: the top-level page, then each subcommand's synopsis,
/// description and options.
pub fn render() -> String {
    let cmd = crate::cli::Cli::command();
    let mut out = Vec::new();
    let man = clap_mangen::Man::new(cmd.clone()).date("");
    // Writing into a Vec cannot fail.
    let _ = man.render(&mut out);
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set() && s.get_name() != "help") {
        let name = format!("vhostd {}", sub.get_name());
        let sub = sub.clone().bin_name(name.clone());
        out.extend_from_slice(format!(".SH \"{}\"\n", name.to_uppercase()).as_bytes());
        let m = clap_mangen::Man::new(sub);
        let _ = m.render_synopsis_section(&mut out);
        let _ = m.render_description_section(&mut out);
        let _ = m.render_options_section(&mut out);
    }
    out.extend_from_slice(EXTRA.as_bytes());
    String::from_utf8_lossy(&out).into_owned()
}

const EXTRA: &str = r#".SH "CONFIGURATION FILE"
\fBvhostd \-\-config\fR \fIFILE\fR serves every device of a TOML file: top\-level keys
\fBcontrol\fR, \fBmetrics\fR and \fBlog\-format\fR, then one \fB[[net]]\fR or \fB[[blk]]\fR
table per device with an optional \fBname\fR and the long options of
\fBvhostd net\fR or \fBvhostd blk\fR as keys (\fBsocket\-path\fR, \fBbackend\fR, \fBqueues\fR,
\fBmode\fR, \fBcpus\fR, ...; a flag is \fBtrue\fR). Errors name the file, line and key.
.SH SIGNALS
SIGINT and SIGTERM stop vhostd cleanly (sockets removed, counters printed on
stdout); SIGUSR1 prints the counters without stopping.
.SH ENVIRONMENT
\fBVHOSTD_LOG\fR sets the log filter (e.g. \fBdebug\fR). \fBNOTIFY_SOCKET\fR (set by
systemd for Type=notify) receives READY=1 once every socket listens.
.SH "EXIT STATUS"
0 after a clean stop; 1 when a device cannot be set up or stops with an
error; 2 for a bad argument or configuration file.
.SH "SEE ALSO"
\fBqemu\-system\-x86_64\fR(1), \fBdpdk\-testpmd\fR(1); README.md and ARCHITECTURE.md of vhostd.
"#;
