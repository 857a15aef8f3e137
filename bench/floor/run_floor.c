/*
 * The floor of a PostgreSQL-coordinated run, for bench/run-overhead.py: the least any client
 * must do to run a command at most once at a time with a fenced, durable result.
 *
 *   run_floor SCHEMA TARGET COMMAND [ARGS...]
 *
 * One connection start, one acquiring statement that takes the lease row and a new fence in a
 * durable commit, the command (fork + exec + wait), and one statement that stores the result
 * under the fence and releases the lease in a durable commit. Nothing else: no schema check,
 * no heartbeat, no watchdog, no outbox event, no queue, no fence floor across failovers, no
 * parameters (the simple query protocol, literals this program made itself).
 *
 * It speaks the wire protocol itself instead of linking libpq: Debian's libpq loads the TLS,
 * Kerberos and LDAP libraries at every start (about 1 ms here), which is the library's cost,
 * not the floor's. So it reaches PostgreSQL only on the local socket (PGHOST if it is a
 * directory, else /var/run/postgresql; PGPORT, else 5432) as PGUSER or the current OS user,
 * database PGDATABASE or the user's name, and only where no password is asked (trust or peer).
 * Its tables (SCHEMA.floor_leases, SCHEMA.floor_runs) are made by the benchmark. Exits 75 when
 * the lease is held, 70 on a database error, else with the command's exit code.
 */
#include <arpa/inet.h>
#include <pwd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int db = -1;
static char buf[1 << 16];

static void die(const char *what) {
    fprintf(stderr, "run_floor: %s\n", what);
    exit(70);
}

static void send_all(const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(db, p, n);
        if (w <= 0)
            die("cannot write to the server");
        p += w;
        n -= (size_t)w;
    }
}

static void read_all(char *p, size_t n) {
    while (n > 0) {
        ssize_t r = read(db, p, n);
        if (r <= 0)
            die("the server closed the connection");
        p += r;
        n -= (size_t)r;
    }
}

/* Reads one message: its type, and its body into buf (NUL-terminated). */
static char message(uint32_t *len) {
    char head[5];
    read_all(head, 5);
    uint32_t n;
    memcpy(&n, head + 1, 4);
    n = ntohl(n) - 4;
    if (n >= sizeof buf)
        die("a message too large for the floor");
    read_all(buf, n);
    buf[n] = 0;
    *len = n;
    return head[0];
}

/* Runs one simple query; returns the first column of its first row (or "" without one) and
 * in *rows the command tag's row count. Dies on an error. */
static void query(const char *sql, char *first, size_t first_size, long *rows) {
    uint32_t n = (uint32_t)strlen(sql) + 1, be = htonl(n + 4);
    char head[5] = {'Q'};
    memcpy(head + 1, &be, 4);
    send_all(head, 5);
    send_all(sql, n);
    first[0] = 0;
    *rows = 0;
    const char *error = NULL;
    char error_text[512];
    for (;;) {
        uint32_t len;
        char t = message(&len);
        if (t == 'D' && first[0] == 0) {
            int32_t col;
            memcpy(&col, buf + 2, 4);
            col = (int32_t)ntohl((uint32_t)col);
            if (col >= 0 && (size_t)col < first_size) {
                memcpy(first, buf + 6, (size_t)col);
                first[col] = 0;
            }
        } else if (t == 'C') {
            const char *sp = strrchr(buf, ' ');
            *rows = sp ? atol(sp + 1) : 0;
        } else if (t == 'E') {
            /* The fields: find the message ('M'). */
            for (char *f = buf; f < buf + len && *f; f += strlen(f) + 1)
                if (*f == 'M') {
                    snprintf(error_text, sizeof error_text, "%s", f + 1);
                    error = error_text;
                }
            if (!error)
                error = "the server reported an error";
        } else if (t == 'Z') {
            if (error)
                die(error);
            return;
        }
    }
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: run_floor SCHEMA TARGET COMMAND [ARGS...]\n");
        return 64;
    }
    const char *schema = argv[1], *target = argv[2];
    const char *host = getenv("PGHOST"), *port = getenv("PGPORT");
    const char *user = getenv("PGUSER"), *dbname = getenv("PGDATABASE");
    if (!host || host[0] != '/')
        host = "/var/run/postgresql";
    if (!port)
        port = "5432";
    if (!user) {
        struct passwd *pw = getpwuid(getuid());
        if (!pw)
            die("who am I?");
        user = pw->pw_name;
    }
    if (!dbname)
        dbname = user;

    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s/.s.PGSQL.%s", host, port);
    db = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (db < 0 || connect(db, (struct sockaddr *)&addr, sizeof addr) < 0)
        die("cannot connect to the local socket");
    /* StartupMessage: protocol 3.0, user, database. */
    char start[512];
    size_t n = 8;
    n += (size_t)snprintf(start + n, sizeof start - n, "user%c%s%cdatabase%c%s%c%c", 0, user, 0, 0,
                          dbname, 0, 0);
    uint32_t be = htonl((uint32_t)n), version = htonl(196608);
    memcpy(start, &be, 4);
    memcpy(start + 4, &version, 4);
    send_all(start, n);
    for (;;) {
        uint32_t len;
        char t = message(&len);
        if (t == 'R') {
            uint32_t code;
            memcpy(&code, buf, 4);
            if (ntohl(code) != 0)
                die("the server asks for a password; the floor connects only where none is asked");
        } else if (t == 'E') {
            die("the server refused the connection");
        } else if (t == 'Z') {
            break;
        }
    }

    char sql[1024], fence[32];
    long rows;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    char token[64];
    snprintf(token, sizeof token, "%d-%ld-%ld", (int)getpid(), (long)now.tv_sec, now.tv_nsec);
    snprintf(sql, sizeof sql,
             "INSERT INTO \"%s\".floor_leases AS l (target, token, fence, heartbeat_at)"
             " VALUES ('%s', '%s', 1, now())"
             " ON CONFLICT (target) DO UPDATE SET token = excluded.token, fence = l.fence + 1,"
             " heartbeat_at = now() WHERE l.token IS NULL RETURNING fence",
             schema, target, token);
    query(sql, fence, sizeof fence, &rows);
    if (rows == 0)
        return 75;

    pid_t pid = fork();
    if (pid < 0)
        die("cannot fork");
    if (pid == 0) {
        execvp(argv[3], argv + 3);
        _exit(127);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0)
        ;
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);

    char ignored[8];
    snprintf(sql, sizeof sql,
             "WITH saved AS (INSERT INTO \"%s\".floor_runs (target, fence, exit_code, finished_at)"
             " SELECT '%s', %s, %d, now() WHERE EXISTS ("
             " SELECT 1 FROM \"%s\".floor_leases WHERE target = '%s' AND token = '%s') RETURNING 1)"
             " UPDATE \"%s\".floor_leases SET token = NULL"
             " WHERE target = '%s' AND token = '%s' AND EXISTS (SELECT 1 FROM saved)",
             schema, target, fence, code, schema, target, token, schema, target, token);
    query(sql, ignored, sizeof ignored, &rows);
    if (rows != 1)
        die("the lease was taken over; the result is not saved");
    send_all("X\0\0\0\4", 5);
    return code;
}
