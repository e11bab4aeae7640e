//! Sessions of roles other than the cluster's superuser: an application role's connection and
//! its pgbench, with its own password (the nodes' `pg_hba.conf` asks every TCP client for one).

use std::process::Command;

use remus_test_support::cluster::TestCluster;

/// A login role and its password.
#[derive(Clone, Debug)]
pub struct Role {
    pub name: String,
    pub password: String,
}

impl Role {
    pub fn new(name: &str, password: &str) -> Role {
        Role {
            name: name.to_string(),
            password: password.to_string(),
        }
    }

    /// The cluster's superuser, `postgres`, with the generated password.
    pub fn superuser(c: &TestCluster) -> Role {
        Role::new("postgres", &c.password().unwrap())
    }

    /// `CREATE ROLE <name> LOGIN PASSWORD '<password>'`, to run on each node (roles belong to
    /// one PostgreSQL cluster).
    pub fn create_sql(&self) -> String {
        format!(
            "CREATE ROLE {} LOGIN PASSWORD '{}'",
            self.name,
            self.password.replace('\'', "''")
        )
    }
}

/// A connection to node `node` as `role`, over TCP like [`TestCluster::connect`].
pub fn connect_as(
    c: &TestCluster,
    node: &str,
    role: &Role,
) -> Result<postgres::Client, postgres::Error> {
    connect_with_options(c, node, role, None)
}

/// [`connect_as`] with startup options `options` (`-c name=value …`).
pub fn connect_with_options(
    c: &TestCluster,
    node: &str,
    role: &Role,
    options: Option<&str>,
) -> Result<postgres::Client, postgres::Error> {
    let state = c.state().unwrap();
    let n = state.node(node).unwrap();
    let mut config = postgres::Config::new();
    config
        .host(&n.host)
        .port(n.port)
        .user(&role.name)
        .password(&role.password)
        .dbname("postgres")
        .connect_timeout(std::time::Duration::from_secs(10));
    if let Some(options) = options {
        config.options(options);
    }
    config.connect(postgres::NoTls)
}

/// `pgbench <args>` against `node` as `role` ([`TestCluster::pgbench`] with the role's name and
/// password in place of the superuser's).
pub fn pgbench_as(c: &TestCluster, node: &str, role: &Role, args: &[&str]) -> Command {
    let mut cmd = c.pgbench(node, args);
    cmd.env("PGUSER", &role.name)
        .env("PGPASSWORD", &role.password);
    cmd
}
